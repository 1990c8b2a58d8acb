"""Caption evaluation metrics."""
