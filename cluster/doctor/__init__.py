"""`pstrain doctor`: checks a machine (and a running cluster) before a run fails on it."""
