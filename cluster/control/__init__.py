"""pstrain's own control plane over gRPC: registration, heartbeats, status and stop (no tensors)."""
