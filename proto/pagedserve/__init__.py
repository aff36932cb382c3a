"""pagedserve's gRPC API: generated code next to its .proto files (see docs/grpc.md)."""
