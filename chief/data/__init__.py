"""Which data a run reads: the training source chosen for a job, and the eval set the chief scores."""
