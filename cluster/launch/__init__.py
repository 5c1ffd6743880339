"""Processes: the launcher, its supervisor, `pstrain node`, and the machine facts they need (ports, hosts, GPUs)."""
