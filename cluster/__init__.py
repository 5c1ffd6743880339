"""pstrain's cluster side, shared by every role.

Pure modules here (no sockets, no processes): `config` (TOML + flags -> frozen config), `task_setup`
(TF_CONFIG and environment per task), `rundir`, `policy` (restart decisions), `task` (TaskId),
`errors` (the error hierarchy and exit codes), `stop` (the stop trap), `versions`. Around them:
`control/` (pstrain's gRPC control plane: registration, heartbeats, status, stop), `launch/`
(processes: launcher, supervisor, `pstrain node`) and `cli` (the `pstrain` command).
"""

__version__ = "0.1.0"
