"""`pstrain plan` against the step it predicts, measured here: the model fitted from its five short
runs (1 and 2 workers on 1 and 2 ps, 1 worker on 4 ps) and its two hybrid runs (1 and 2 workers with
train.dense = "allreduce") must predict each of them within 25 % (every run made twice and the faster
kept), the 4-worker runs on 1 and 2 ps it did not see within 40 % (each made three times, interleaved,
the fastest kept), and propose the ps count that measured faster. Every task shares this machine's
cores, so the prediction is for tasks sharing the cores the measured runs kept busy (`--cores here`,
`--bandwidth loopback`), and the 4-worker steps are measured in the same test, under the same load.
The unseen runs get the wider band because 7 processes on 2 shared cores of a CI runner read from
-34 % to +31 % of the prediction over three CI runs (-12 % to -28 % on this machine): docs/plan.md."""

from __future__ import annotations

import re
import signal

import pytest

from cluster.forecast.measure import measure
from tests.helpers import assert_no_orphans, descendant_pids, run_pstrain

pytestmark = pytest.mark.cluster

JOB, BATCH, STEPS = "chief.jobs.digits", 64, 300
FITTED_TOLERANCE, UNSEEN_TOLERANCE = 0.25, 0.40


@pytest.mark.alone  # its measured steps must not share the cores with another test's cluster
@pytest.mark.timeout(900)  # 20 measured runs
def test_plan_predicts_the_measured_step_and_proposes_the_faster_ps_count():
    # Every run is measured more than once and the fastest kept: another process waking on the 2 shared
    # cores only ever adds time and CPU (two runs of 4 x 2 here read 27.7 and 36.2 ms, the second with
    # 37 % more ps CPU); a fit on single runs against the faster of two unseen ones over-predicted them
    # by 26 % and 31 % on a CI runner, and the next runner, fitting on the faster of two, under-predicted
    # 4 x 2 by 34 % (43.7 ms, with 79 ms of CPU where the fit expected about 57).
    args = ["plan", "--job", JOB, "--global-batch-size", str(BATCH), "--measure-steps", str(STEPS), "--measure-repeats", "2"]
    result = run_pstrain([*args, "--workers", "4", "--ps", "1,2", "--cores", "here", "--bandwidth", "loopback"], timeout=600)
    assert result.returncode == 0, result.output
    assert_no_orphans(result)
    pairs = {}  # (workers, ps, train.dense) -> (measured ms, predicted ms)
    measured_line = r"(\d+) workers, (\d+) ps( \(train.dense = \"allreduce\"\))?: measured ([\d.]+) ms, model ([\d.]+) ms"
    for w, p, hybrid, measured, model in re.findall(measured_line, result.output):
        pairs[int(w), int(p), "allreduce" if hybrid else "ps"] = float(measured), float(model)
    predicted = {int(p): float(ms) for p, ms in re.findall(r"^\| ps \| 4 \| (\d) \| ([\d.]+) \|", result.output, re.M)}
    # train.dense = "allreduce" predicted beside "ps" on 1 ps; on 2 ps the job's 512 KiB kernel would be split,
    # which the launch refuses: the plan says so for that scenario instead of a prediction
    assert re.search(r"^\| allreduce \| 4 \| 1 \| [\d.]+ \|", result.output, re.M), result.output
    assert re.search(r"^  4 workers, 1 ps: train.dense = \"(ps|allreduce)\" \(", result.output, re.M), result.output
    refused = r'^  4 workers, 2 ps: train.dense = "ps" \("ps" [\d.]+ ms, bound by [a-zA-Z ]+\); "allreduce" is refused there: '
    refused += r"the dense variable \S+ would be split over 2 ps; it takes --ps 1$"
    assert re.search(refused, result.output, re.M), result.output
    fitted = [(1, 1, "ps"), (1, 2, "ps"), (1, 4, "ps"), (2, 1, "ps"), (2, 2, "ps"), (1, 1, "allreduce"), (2, 1, "allreduce")]
    assert sorted(pairs) == sorted(fitted) and sorted(predicted) == [1, 2], result.output
    # Not the 4-worker hybrid: it gathers in 3 ring steps where the fit saw one all-reduce, and with 6 tasks
    # on 2 cores each ring step waits for its next worker to be scheduled: the faster of two runs read 28.2 ms
    # against 15.9 predicted (docs/plan.md says so).
    runs = {1: [], 2: []}
    for _ in range(3):  # interleaved, so a slow spell of the runner does not land on one ps count only
        for ps in (1, 2):
            runs[ps].append(measure(JOB, 4, ps, BATCH, STEPS, STEPS // 3))
    for ps in (1, 2):
        run = min(runs[ps], key=lambda o: o.step_s)
        cpu = ", ".join(f"{role} {seconds * 1e3:.2f}" for role, seconds in sorted(run.cpu_s.items()))
        steps = ", ".join(f"{o.step_s * 1e3:.2f}" for o in runs[ps])
        print(f"4 workers {ps} ps: {steps} ms; fastest's CPU ms per step: {cpu}; {run.cores_busy:.2f} cores busy")
        pairs[4, ps, "ps"] = run.step_s * 1e3, predicted[ps]
    errors = {key: model / measured - 1 for key, (measured, model) in pairs.items()}
    print(
        "\n".join(
            f"{w} workers {p} ps {dense}: measured {pairs[w, p, dense][0]:.2f} ms, model {pairs[w, p, dense][1]:.2f} ms, {e:+.0%}"
            for (w, p, dense), e in sorted(errors.items())
        )
    )
    assert all(abs(e) <= FITTED_TOLERANCE for key, e in errors.items() if key[0] < 4), (errors, result.output)
    assert all(abs(e) <= UNSEEN_TOLERANCE for key, e in errors.items() if key[0] == 4), (errors, result.output)
    # The plan's decision: where the two measured 4-worker steps differ by more than a tenth, it proposes the faster.
    one, two = pairs[4, 1, "ps"][0], pairs[4, 2, "ps"][0]
    proposed = int(re.search(r"^pstrain plan: 4 workers: use (\d) ps:", result.output, re.M).group(1))
    if max(one, two) > 1.1 * min(one, two):
        assert proposed == (1 if one < two else 2), (one, two, result.output)


def test_plan_interrupted_mid_measurement_stops_and_reaps_its_run():
    def started() -> bool:
        from tests import helpers

        return len(descendant_pids({helpers.current_launcher})) >= 4  # the launcher, the chief and its servers

    result = run_pstrain(["plan", "--job", JOB, "--measure-steps", "5000"], timeout=120, signal_when=started, send=signal.SIGINT)
    assert result.returncode == 130, result.output
    assert result.output.strip().endswith("pstrain: error: pstrain plan: interrupted; the measured run was stopped and reaped")
    assert_no_orphans(result)


def test_plan_of_a_job_whose_run_fails_says_so_in_one_line():
    # The model builds (plan reads its variables before measuring), then the measured run fails tracing the loss.
    result = run_pstrain(["plan", "--job", "tests.jobs.broken:LossRaises", "--measure-steps", "200"], timeout=120)
    assert result.returncode == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert last == "pstrain: error: pstrain plan: the measured run (1 workers, 1 ps) exited with 2; --log FILE keeps its output"
    assert "Traceback" not in result.output
    assert_no_orphans(result)


def test_plan_of_a_job_whose_model_cannot_be_built_says_so_before_measuring():
    result = run_pstrain(["plan", "--job", "tests.jobs.broken:Raises", "--measure-steps", "200"], timeout=120)
    assert result.returncode == 2, result.output
    last = result.output.strip().splitlines()[-1]
    expected = "pstrain: error: pstrain plan: could not build tests.jobs.broken:Raises's model: "
    expected += "ValueError: layer sizes must be positive"
    assert last == expected and "measuring" not in result.output and "Traceback" not in result.output
    assert_no_orphans(result)
