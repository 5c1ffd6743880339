"""pstrain: what every role shares — config, TF_CONFIG plans, launcher."""

__version__ = "0.1.0"
