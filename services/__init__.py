"""pagedserve's gRPC services: the engine service (token ids, over `AsyncLLMEngine`), the
tokenizer service (the public text API) and the `pagedserve` command. See docs/grpc.md."""
