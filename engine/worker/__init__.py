"""The model runner: builds the step's tensors, runs the model, samples."""
