"""A passive TensorFlow server task (worker or ps): it serves until it is told to stop."""
