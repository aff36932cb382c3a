"""Python clients of pagedserve's public gRPC API. They import only the generated code
(`pagedserve.v1`) and grpc, never `engine/`, so a client installs without torch."""
