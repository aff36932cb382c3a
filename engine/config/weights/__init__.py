"""How a model's weights are stored and run: the dtype, CPU quantization methods, and the
quantized-checkpoint formats (FP8, AWQ, GPTQ) read from a model directory."""
