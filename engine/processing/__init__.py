"""Input and output processing around the scheduler: prompts to checked token ids and `Request`s
(input_processor, request_builder), scheduler updates to `RequestOutput`s (output_processor) with
incremental detokenization and stop strings, `bad_words` to token ids, and beam search.

Torch-free: the tokenizer service imports the detokenizer and bad-word helpers from here.
"""
