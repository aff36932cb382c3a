"""Finding, reading and loading model weights: model resolution and the converted-GGUF cache
(model_loader), GGUF headers and quantized blocks, safetensors read with pread, and the one
generic weight loader that maps checkpoint names to parameters as data."""
