"""`pstrain status` as a table (pure formatting of the status dict)."""

from __future__ import annotations

COLUMNS = ("TASK", "STATE", "HOST", "PID", "HEARTBEAT", "STEP", "STEPS/S", "GRADIENTS", "CPU%", "MEMORY")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def format_status(status: dict) -> str:
    rows = []
    for t in status["tasks"]:
        if t["state"] == "missing":
            rows.append((t["task"], "missing", f"(expected at {t['address']})", "", "", "", "", "", "", ""))
            continue
        gpu = f" +{_mib(t['gpu_memory_bytes'])} GPU" if t.get("gpu_memory_bytes") else ""
        rows.append(
            (
                t["task"],
                t["state"],
                t["host"],
                str(t["pid"]),
                f"{t['heartbeat_age_s']:.1f}s ago",
                str(t["step"]),
                f"{t['steps_per_s']:.2f}",
                str(t["gradients"]) if t["task"].startswith("worker") else "",
                f"{t['cpu_percent']:.0f}",
                _mib(t["rss_bytes"]) + gpu,
            )
        )
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(COLUMNS)]
    lines = [f"cluster {status['state']}, step {status['step']}/{status['total_steps']}"]
    lines.append("  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True)).rstrip())
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)
