"""Turning logits into tokens and logprobs, vectorised over the batch."""
