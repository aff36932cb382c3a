"""The engine front: `LLMEngine` (synchronous, vLLM's API over the scheduler and the executor), its
administrative API, and `AsyncLLMEngine` with the engine thread that runs the step loop and the
commands that cross between that thread and the event loop.

    AsyncLLMEngine (event loop) ──commands──▶ EngineThread ──▶ LLMEngine.step()
                               ◀──outputs───
"""
