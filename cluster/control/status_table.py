"""`pstrain status` as a table (pure formatting of the status dict)."""

from __future__ import annotations

import time

COLUMNS = ("TASK", "STATE", "HOST", "PID", "HEARTBEAT", "STEP", "STEPS/S", "GRADIENTS", "CPU%", "MEMORY", "RESTARTS")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def restarts_cell(row: dict, max_restarts: int) -> str:
    """ "1 of 3 until 22:31:05": restarts that count against the budget and when they stop counting."""
    used, reset_at = row.get("restarts", 0), row.get("restarts_reset_at", 0.0)
    if not used:
        return f"0 of {max_restarts}"
    return f"{used} of {max_restarts} until {time.strftime('%H:%M:%S', time.localtime(reset_at))}"


def step_age(status: dict) -> str:
    """ " (0.4s old, from metrics.jsonl)": how old the shown step is, and where it came from when not the chief's report."""
    age = status.get("step_age_s", -1.0)
    if age < 0:
        return ""
    source = status.get("step_from", "")
    return f" ({age:.1f}s old" + (f", from {source})" if source else ")")


def format_status(status: dict) -> str:
    rows = []
    for t in status["tasks"]:
        if t["state"] == "missing":
            restarts = restarts_cell(t, status.get("max_restarts", 0))
            rows.append((t["task"], "missing", f"(expected at {t['address']})", "", "", "", "", "", "", "", restarts))
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
                restarts_cell(t, status.get("max_restarts", 0)),
            )
        )
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(COLUMNS)]
    window = status.get("restart_window_s", 0.0)
    budget = f"; restarts: at most {status.get('max_restarts', 0)} per task in {window / 60:g} min" if window else ""
    total = f"/{status['total_steps']}" if status["total_steps"] else ""  # 0: by epochs, counted by the chief
    lines = [f"cluster {status['state']}, step {status['step']}{total}{step_age(status)}{budget}"]
    lines.append("  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True)).rstrip())
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)
