"""`pstrain plot RUN_DIR`: PNGs of a run from its metrics.jsonl, in RUN_DIR/plots/.

The series are prepared by pure functions over the records; `render` draws them with matplotlib's
Agg backend (no display needed) and writes each PNG as tmp + rename.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cluster.errors import ConfigError
from cluster.rundir import RunDir

Series = tuple[list[int], list[float]]
FIGSIZE, DPI = (6.4, 3.6), 100  # 640 x 360 pixels


def load_records(layout: RunDir) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(step records, eval records) of metrics.jsonl; the "done" line counts as an eval at the last step."""
    path = layout.metrics
    if not path.exists():
        raise ConfigError(f"pstrain plot: {path} not found; give the --run-dir of a run")
    steps, evals = [], []
    for record in layout.read_metrics():
        if record.get("event") == "eval":
            evals.append(record)
        elif record.get("event") == "done":
            final = {k.removeprefix("eval_"): v for k, v in record.items() if k.startswith("eval_")}
            if final:
                evals.append({"step": record.get("steps"), **final})
        elif "step" in record:
            steps.append(record)
    if not steps:
        raise ConfigError(f"pstrain plot: {path} has no step records yet; plot after the first step")
    return steps, evals


def loss_series(steps: list[dict], evals: list[dict]) -> dict[str, Series]:
    out = {"train": ([r["step"] for r in steps], [float(r["loss"]) for r in steps])}
    points = [(r["step"], float(r["loss"])) for r in evals if isinstance(r.get("step"), int) and "loss" in r]
    if points:
        out["eval"] = ([s for s, _ in points], [v for _, v in points])
    return out


def phase_series(steps: list[dict]) -> tuple[list[int], dict[str, list[float]]]:
    """Step time split into its timing phases (ms), plus "other" so that the stack sums to the step time."""
    x = [r["step"] for r in steps]
    phases: list[str] = []
    for r in steps:
        phases += [p for p in r.get("timing", {}) if p not in phases]
    stacks = {p: [1000 * float(r.get("timing", {}).get(p, 0.0)) for r in steps] for p in phases}
    total = [1000 * float(r["seconds"]) for r in steps]
    stacks["other" if phases else "step"] = [max(0.0, t - sum(s[i] for s in stacks.values())) for i, t in enumerate(total)]
    return x, stacks


def throughput_series(steps: list[dict], examples_per_step: int) -> Series:
    return [r["step"] for r in steps], [examples_per_step / float(r["seconds"]) if r["seconds"] > 0 else 0.0 for r in steps]


def gradient_series(steps: list[dict]) -> dict[int, Series]:
    """Gradients applied per worker, cumulative, at every step."""
    workers = sorted({w for r in steps for w in r.get("workers", [])})
    counts = dict.fromkeys(workers, 0)
    out: dict[int, Series] = {w: ([], []) for w in workers}
    for r in steps:
        for w in r.get("workers", []):
            counts[w] += 1
        for w in workers:
            out[w][0].append(r["step"])
            out[w][1].append(float(counts[w]))
    return out


def examples_per_step(layout: RunDir) -> int:
    """The global batch size the run was started with (cluster.json)."""
    try:
        return int(layout.record()["train"]["global_batch_size"])
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"pstrain plot: {layout.config_record} unreadable ({e}); give the --run-dir of a run") from None


def y_limit(totals: list[float]) -> float | None:
    """An upper y limit that keeps outliers (the first steps trace functions) from flattening the rest."""
    ordered = sorted(totals)
    median = ordered[len(ordered) // 2] if ordered else 0.0
    return 4 * median if median > 0 and ordered[-1] > 8 * median else None


def render(layout: RunDir) -> list[Path]:
    """Write the PNGs; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps, evals = load_records(layout)
    out_dir = layout.plots
    out_dir.mkdir(exist_ok=True)
    written = []

    def save(fig, name: str, title: str, ylabel: str) -> None:
        ax = fig.axes[0]
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        fig.tight_layout()
        path, tmp = out_dir / f"{name}.png", out_dir / f".{name}.png.tmp"
        fig.savefig(tmp, dpi=DPI, format="png")
        plt.close(fig)
        tmp.replace(path)
        written.append(path)

    fig, ax = plt.subplots(figsize=FIGSIZE)
    for name, (x, y) in loss_series(steps, evals).items():
        ax.plot(x, y, label=name, marker="o" if name == "eval" else None)
    save(fig, "loss", "loss", "loss")

    fig, ax = plt.subplots(figsize=FIGSIZE)
    x, stacks = phase_series(steps)
    ax.stackplot(x, *stacks.values(), labels=list(stacks))
    top = y_limit([sum(s[i] for s in stacks.values()) for i in range(len(x))])
    ax.set_ylim(0, top)
    save(fig, "step_time", "step time by phase" + (" (outliers clipped)" if top else ""), "ms")

    fig, ax = plt.subplots(figsize=FIGSIZE)
    ax.plot(*throughput_series(steps, examples_per_step(layout)))
    save(fig, "examples_per_second", "throughput", "examples/s")

    fig, ax = plt.subplots(figsize=FIGSIZE)
    for worker, (x, y) in gradient_series(steps).items():
        ax.plot(x, y, label=f"worker {worker}")
    save(fig, "gradients_per_worker", "gradients applied per worker", "gradients (cumulative)")
    return written
