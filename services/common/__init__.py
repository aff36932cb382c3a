"""What both servers share: the grpc.aio server with health and reflection, exceptions to status
codes, malformed-bytes handling (wire), tracing, Prometheus metrics, structured logs and the
live-request limits."""
