"""Transport security: TLS on the public endpoint, mutual TLS between gateway, draft and verify workers.

Every service takes the same flags: its certificate and key (served to its callers, and shown as
the client certificate when it calls another service) and the CA that signs the services'
certificates (a worker accepts only callers holding a certificate from it; a caller accepts only
workers holding one). Plaintext needs --insecure, said out loud: with neither certificates nor
--insecure a service refuses to start, so a forgotten Secret never silently means plaintext.

Workers register their pod IPs, which no certificate names; --tls-server-name is the one name
their certificates carry (a DNS SAN) and callers check instead of the address they dial.
Files are read at start-up (a Kubernetes Secret update takes effect on the next rollout).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class TlsConfig:
    cert: bytes               # PEM: this service's certificate chain
    key: bytes                # PEM: its private key
    ca: bytes                 # PEM: the CA that signs every Tandem service's certificate
    server_name: str = ""     # the name checked in a worker's certificate; "" = the host dialed
    public_cert: bytes = b""  # the gateway's public endpoint only: another certificate (else cert)
    public_key: bytes = b""

    def server_credentials(self, *, public: bool = False) -> grpc.ServerCredentials:
        """public: the gateway's endpoint, where clients prove who they are with bearer tokens, not
        certificates; otherwise a client certificate signed by the CA is required."""
        if public:
            pair = (self.public_key or self.key, self.public_cert or self.cert)
            return grpc.ssl_server_credentials([pair])
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _read(flag: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise SystemExit(f"{flag}: cannot read {path}: {e.strerror}") from None
    if b"-----BEGIN" not in data:
        raise SystemExit(f"{flag}: {path} is not a PEM file")
    return data


def tls_from_args(args: argparse.Namespace) -> TlsConfig | None:
    """The TLS configuration, None under --insecure; exits with what is missing otherwise."""
    files = {"--tls-cert-file": args.tls_cert_file, "--tls-key-file": args.tls_key_file,
             "--tls-ca-file": args.tls_ca_file}
    if args.insecure:
        if any(files.values()):
            raise SystemExit("--insecure and --tls-* files exclude each other; choose one")
        return None
    missing = [flag for flag, path in files.items() if not path]
    if missing:
        raise SystemExit(f"TLS needs {', '.join(missing)} (or --insecure for plaintext on a local run)")
    public = {}
    pub_cert, pub_key = getattr(args, "public_tls_cert_file", ""), getattr(args, "public_tls_key_file", "")
    if bool(pub_cert) != bool(pub_key):
        raise SystemExit("--public-tls-cert-file and --public-tls-key-file go together")
    if pub_cert:
        public = {"public_cert": _read("--public-tls-cert-file", pub_cert),
                  "public_key": _read("--public-tls-key-file", pub_key)}
    return TlsConfig(cert=_read("--tls-cert-file", args.tls_cert_file), key=_read("--tls-key-file", args.tls_key_file),
                     ca=_read("--tls-ca-file", args.tls_ca_file), server_name=args.tls_server_name, **public)
