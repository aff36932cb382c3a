"""Model code (our own torch modules over the paged cache) and weight loaders."""
