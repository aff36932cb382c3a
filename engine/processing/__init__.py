"""Input and output processing around the scheduler: prompts to checked token ids and `Request`s
(input_processor, request_builder), scheduler updates to `RequestOutput`s (output_processor) with
incremental detokenization and stop strings. The detokenizer, bad words and beam search that the
tokenizer service shares live in engine/api/.
"""
