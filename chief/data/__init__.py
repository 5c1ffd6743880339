"""Training and eval data: which examples feed which gradient, and how a worker or the chief reads them."""
