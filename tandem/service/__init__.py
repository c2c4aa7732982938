"""What every service shares: gRPC servers and channels, interceptors, TLS, flags, logs, metrics, traces, and the internal wire format."""
