"""The engine service process: `pagedserve.v1.EngineService` over one `AsyncLLMEngine` (server),
its operator and LoRA RPCs, the proto converters, and vLLM's engine protocol
(`vllm.grpc.engine.VllmEngine`) on the same port for gateways such as smg."""
