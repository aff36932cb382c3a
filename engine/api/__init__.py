"""What crosses the process boundary: the engine's vocabulary that the services share.

Sampling and beam-search parameters, structured-output constraints, outputs, errors, the
incremental detokenizer, bad words to token ids, prefix-cache block hashing and the model's
files (config, generation config, tokenizer). The tokenizer service (the tier that scales out,
and never loads torch) imports these modules and nothing else of the engine.

The rule, checked by import-linter (pyproject.toml, tests/test_import_contracts.py): modules
here import the standard library, each other, and transformers only inside the functions that
read a tokenizer or config; never torch, and no other part of the engine.
"""
