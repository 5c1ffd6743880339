"""The job contract: what a job file provides (Job, its compiled form, the as-written conversion, the ops
it may use, its arrays)."""
