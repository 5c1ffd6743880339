"""Jobs that ship with pstrain (examples and templates for `--job chief.jobs.NAME`).

The job contract (`Job`, `load_job`, `JobError`) lives in chief/job.py; it is re-exported here for
jobs and scripts that import it from `chief.jobs`.
"""

from chief.job import Job, JobError, load_job

__all__ = ["Job", "JobError", "load_job"]
