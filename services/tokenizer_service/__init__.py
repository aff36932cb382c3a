"""The tokenizer service process: the public text API (`pagedserve.v1.TextGenerationService`).
Its server, the Generate/Encode servicer, preprocessing (chat templates, tokenization, checks
that need text) and request-cost limits, the text streams (detokenization, stop strings), beam
search over the engine API, LoRA admin, and `replicas/`: the engine replicas behind it.

It never imports torch: it is the tier that scales out."""
