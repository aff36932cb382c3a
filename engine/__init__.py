"""pagedserve engine."""
