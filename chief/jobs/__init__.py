"""Jobs that ship with pstrain (examples and templates for `--job chief.jobs.NAME`).

The job contract (`Job`, `load_job`, `JobError`) lives in chief/contract/job.py; it is re-exported here for
jobs and scripts that import it from `chief.jobs`.
"""

from chief.contract.job import Job, JobError, load_job

__all__ = ["Job", "JobError", "load_job"]
