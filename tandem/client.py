"""A small command-line client: `python -m tandem.client "prompt"` streams from the gateway."""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc as pb_grpc

METHODS = {"model": pb.DRAFT_METHOD_MODEL, "ngram": pb.DRAFT_METHOD_NGRAM, "none": pb.DRAFT_METHOD_NONE,
           "head": pb.DRAFT_METHOD_HEAD}


def build_request(prompt: str, *, chat: bool = False, max_new_tokens: int = 128, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 0.0, seed: int | None = None, method: str = "",
                  k: int = 0, stop: list[str] | None = None, session_id: str = "") -> pb.GenerateRequest:
    sampling = pb.SamplingParameters(temperature=temperature, top_k=top_k, top_p=top_p,
                                     max_new_tokens=max_new_tokens, stop_sequences=stop or [])
    if seed is not None:
        sampling.seed = seed
    req = pb.GenerateRequest(sampling=sampling, session_id=session_id,
                             speculation=pb.SpeculationOptions(method=METHODS.get(method, 0),
                                                               num_speculative_tokens=k))
    if chat:
        req.chat.messages.add(role="user", content=prompt)
    else:
        req.prompt = prompt
    return req


def open_channel(address: str, ca_file: str = "", server_name: str = "") -> grpc.Channel:
    """TLS when given the CA that signed the gateway's certificate, else plaintext."""
    if not ca_file:
        return grpc.insecure_channel(address)
    with open(ca_file, "rb") as f:
        creds = grpc.ssl_channel_credentials(f.read())
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(address, creds, options=options)


def run(address: str, prompt: str, timeout: float = 600, out=sys.stdout, request_id: str = "",
        ca_file: str = "", server_name: str = "", token: str = "", **kwargs) -> pb.GenerateStreamResponse:
    """Streams one generation to `out`; returns the final message (finish reason and usage).
    request_id: sent as x-request-id, which the services' log lines and the trace carry.
    ca_file, server_name: TLS (see open_channel); token: sent as a bearer token."""
    metadata = ((("x-request-id", request_id),) if request_id else ()) + \
        ((("authorization", f"Bearer {token}"),) if token else ())
    with open_channel(address, ca_file, server_name) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        last = None
        for msg in stub.GenerateStream(build_request(prompt, **kwargs), timeout=timeout,
                                      metadata=metadata or None):
            out.write(msg.text)
            out.flush()
            last = msg
    u = last.usage
    print(f"\n\n[{pb.FinishReason.Name(last.finish_reason)}] {u.generated_tokens} tokens, draft {u.draft_method}: "
          f"{u.verify_rounds} verify rounds, acceptance {u.acceptance_rate:.0%} "
          f"({u.accepted_tokens}/{u.draft_tokens}), mean accepted length {u.mean_accepted_length:.2f}",
          file=out, flush=True)
    return last


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="tandem.client", description=__doc__)
    p.add_argument("prompt")
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--method", choices=sorted(METHODS), default="")
    p.add_argument("-k", type=int, default=0, help="speculative tokens per round")
    p.add_argument("--stop", action="append", help="stop sequence (repeatable)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--request-id", default="", help="x-request-id to send (the gateway makes one up otherwise)")
    p.add_argument("--ca-file", default="", help="PEM CA of the gateway's certificate: use TLS")
    p.add_argument("--server-name", default="", help="name to check in the gateway's certificate")
    p.add_argument("--token", default=os.environ.get("TANDEM_TOKEN", ""),
                   help="bearer token (default: $TANDEM_TOKEN)")
    a = p.parse_args(argv)
    try:
        run(a.address, a.prompt, timeout=a.timeout, chat=a.chat, max_new_tokens=a.max_new_tokens,
            temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed, method=a.method,
            k=a.k, stop=a.stop, request_id=a.request_id, ca_file=a.ca_file, server_name=a.server_name,
            token=a.token)
    except grpc.RpcError as e:
        raise SystemExit(f"error: {e.code().name}: {e.details()}")


if __name__ == "__main__":
    main()
