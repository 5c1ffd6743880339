"""A helper process held by its stdin, its lifeline: the namespace maker (netns.py) and the firewall
guardian (firewall.py) each exit when the launcher closes that pipe."""

from __future__ import annotations

import subprocess


def cut(helper: subprocess.Popen, timeout_s: float) -> bool:
    """Close `helper`'s stdin and reap it, killed where it has not exited within `timeout_s`. Returns
    True when it had to be killed (its own clean-up did not run). Never raises for a slow helper."""
    if not helper.stdin.closed:
        helper.stdin.close()
    try:
        helper.wait(timeout=timeout_s)
        return False
    except subprocess.TimeoutExpired:
        helper.kill()
        helper.wait()
        return True
