"""How a run ends: the final checkpoint, evaluation, SavedModel export and done line; or, on a stop, the
checkpoint and the stop's one line."""

from __future__ import annotations

import logging
import time

from chief.export import export_saved_model
from chief.scores import evaluate
from chief.startup import TrainingRun
from chief.state.route import serving_model
from cluster.errors import EXIT_OK
from cluster.run_times import done_fields, done_phrase, run_times
from cluster.rundir import RunDir, latest_checkpoint_step, read_stop_cause
from cluster.stop import StopTrap
from cluster.stop_report import stop_outcome

log = logging.getLogger("pstrain.chief")


def finish(run: TrainingRun, steps: int) -> int:
    """Final checkpoint after `steps` (train.steps, fewer where a callback stopped the run), evaluation
    of the trained weights, SavedModel export, the done line."""
    run.stale_total += run.engine.close()
    if run.first_step < steps:
        run.checkpoints.save(steps)
    final = run.checkpoints.model()  # the weights just saved (or restored): the state itself, or the mirror
    scores = evaluate(run.job, final, run.eval_set)
    exported = serving_model(run.checkpoints, run.job, run.sample)
    if exported is not None:
        export_saved_model(exported, run.sample, run.run_dir.saved_model)
    else:
        run.progress.message(
            f"pstrain: warning: no SavedModel: the model is split over ps and larger than the chief's memory; serve it "
            f"from {run.checkpoints.latest} (tf.train.Checkpoint(model=model_fn()).restore on a machine that holds it)"
        )
    times = run_times(run.starts, time.time())
    done = {"event": "done", "steps": steps, **scores, "stale_dropped_total": run.stale_total}
    run.metrics.write({**done, **done_fields(times), "peak_rss_mib": peak_rss_mib()})
    run.metrics.close()
    summary = ", ".join(f"{k} {v:.4f}" for k, v in scores.items())
    run.progress.message(f"pstrain: {done_phrase(times)}; {summary}; saved model in {run.run_dir.saved_model}")
    return EXIT_OK


def stop_with_checkpoint(run: TrainingRun, done: int, stop: StopTrap, standalone: bool) -> int:
    """Save the state after `done` applied steps (none to save when no step ran, nor when checkpoint
    `done` was just written: a stop during that write); say so and exit as the stop signal asks (in a
    cluster the launcher says it on the console: the chief logs it)."""
    trained = done > run.first_step
    if trained and done == run.saved:
        log.info("checkpoint %d is already written: the stop does not write it again", done)
    elif trained:
        run.checkpoints.save(done)
    run.metrics.close()
    checkpoint = done if trained else latest_checkpoint_step(run.run_dir)
    say_stopped(stop, checkpoint, "saved" if trained else "start-up", standalone, run.progress.message, run.run_dir)
    return stop.exit_code


def peak_rss_mib() -> int:
    """This process's peak resident memory so far, in MiB (the kernel's high-water mark)."""
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # KiB on Linux


def say_stopped(
    stop: StopTrap, checkpoint: int | None, how: str, standalone: bool, message=print, run_dir: RunDir | None = None
) -> None:
    """The stop's one line: on the console standalone; in the chief's log in a cluster, whose launcher
    says it on the console, naming a `pstrain stop` as the launcher wrote it before signalling (`stop_cause`)."""
    commanded = read_stop_cause(run_dir) if run_dir and not standalone else ""
    cause, by_command = (commanded, True) if commanded else (stop.cause, stop.commanded)
    line = stop_outcome(cause, by_command, stop.exit_code, checkpoint, how).line
    if standalone:
        message(line)
    else:
        log.info("%s", line.removeprefix("pstrain: "))
