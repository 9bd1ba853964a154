"""The per-client path at the speed of a hand-written loop, counted on a CPU (issue "Faster than a hand-written loop
on a GPU", part 1): the aten operations raysim dispatches per trained client against its plain-PyTorch twin doing
the same work (benchmarks/twin.py: one model, weights copied in, torch.optim.SGD, the weighted sum on the device; the
prototype methods' twin adds their loss and prototype sums), and the host reads among them. Each op is a kernel
launch on a GPU and each read a stream synchronisation, so these counts say on any CPU what a GPU pays. Counted
with benchmarks/op_count.py's dispatch-mode counter on benchmarks/gpu.py's workload (cnn4, 50 images 3x32x32 a
client, batch 10, one epoch, SGD momentum 0.9, sequential backend, one runner), setup and final evaluation cancelled
out by differencing runs of one and two rounds."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

COHORT = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _counts(method: str):
    import op_count

    rs = op_count.raysim_client_counts(method, cohort=COHORT, clients=COHORT, rounds=(1, 2))
    tw = op_count.twin_client_counts(op_count.TWIN_OBJECTIVE[method], cohort=COHORT, clients=COHORT, rounds=(1, 2))
    return rs, tw


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "fedproto", "fedtgp"])
def test_ops_per_trained_client_within_5_percent_of_the_plain_loop(method):
    import op_count

    rs, tw = _counts(method)
    mine, plain = sum(rs["client steps"].values()), sum(tw.values())
    extra = sorted(((rs["client steps"].get(k, 0) - tw.get(k, 0), k) for k in set(rs["client steps"]) | set(tw)),
                   reverse=True)[:8]
    assert mine <= 1.05 * plain, f"{method}: {mine:.1f} ops per client vs the plain loop's {plain:.1f}; most extra: {extra}"
    # no host read per client: nothing in the client's own step reads a device value ...
    assert rs["client steps"].get(op_count.READ, 0) == 0, rs["client steps"].get(op_count.READ)
    assert tw.get(op_count.READ, 0) == 0
    # ... the runner reads every client's metrics and divergence checks at once, once per step
    assert rs["batched reads"] == pytest.approx(1 / COHORT)


def test_an_executor_is_added_without_touching_the_runner(monkeypatch):
    """Executors are an open interface (raysim/runner/executors.py): a class with enabled / accepts / run, registered
    ahead of the per-client loop, runs the steps it accepts through StepRun's public surface and bookkeeping only;
    the table is the loop's."""
    from raysim.config import make_config
    from raysim.runner import executors
    from raysim.engine.loop import run_experiment
    from raysim.io.results import without_timing
    from tests.conftest import tiny_config

    seen = []

    class Recording(executors.Executor):
        name = "recording"

        def accepts(self, run):
            return not run.evaluate

        def run(self, run):
            seen.append((run.round_idx, run.step.name, tuple(run.client_ids)))
            for cid in run.client_ids:  # the loop's contract through the public surface only
                ctx, down = run.download(cid)
                state = run.state(cid)
                run.seed(cid)
                try:
                    run.finish(cid, getattr(run.algorithm, run.step.method)(down, state, run.data(cid), ctx))
                except Exception as e:
                    run.fail(cid, e)
            return True

    cfg = make_config(tiny_config(rounds=2, backend={"name": "sequential"}))
    plain = without_timing(run_experiment(cfg, write=False).table)
    monkeypatch.setattr(executors, "_REGISTRY", list(executors._REGISTRY))
    executors.register_executor(Recording)
    assert [c.name for c in executors._REGISTRY][-2:] == ["recording", "loop"]
    mine = without_timing(run_experiment(cfg, write=False).table)
    assert [s[:2] for s in seen] == [(0, "update"), (1, "update")]
    import pandas as pd

    pd.testing.assert_frame_equal(plain.drop(columns="run_id").reset_index(drop=True),
                                  mine.drop(columns="run_id").reset_index(drop=True), check_exact=True)


@pytest.mark.parametrize("method,arch", [("fedavg", "cnn_mnist"), ("fedproto", "cnn4"), ("moon", "cnn_mnist")])
def test_vectorised_ops_per_round_do_not_grow_with_the_cohort(method, arch):
    """Issue "a cohort per kernel": the vectorised executor's aten ops per round at cohort 6 are within 1.08x of
    those at cohort 2, and its host reads per round do not grow: a group's starting weights are stacked in one op
    per parameter, its batch orders and dropout masks are counter-based draws computed for the whole group at once
    (cnn_mnist: Dropout2d and dropout), its uploads stay rows of the trained stacks until the partial aggregate
    reduces them in one scan, its metrics are divided and read at once, FedProto's prototypes come from one grouped
    forward and one index_add for the whole group; MOON's previous models and SCAFFOLD's control variates are the
    objective's stacked rows (``LocalStart.rows``), MOON's frozen models one grouped forward each per step (SCAFFOLD,
    FedGen, VHL: benchmarks/PERFORMANCE.md, not repeated here for the suite's time). Before:
    2.25x (FedAvg), 2.44x (FedProto), 3.97x (MOON) and 3.96x (SCAFFOLD) at cohorts 10 and 40; 1.14x at cohorts 2 and
    8 (1.09x at 2 and 6) with cnn_mnist's per-client masks before the counter-based draws."""
    import op_count

    per_round = {}
    for k in (2, 6):
        rs = op_count.raysim_client_counts(method, cohort=k, clients=k, vectorize=True, rounds=(1, 2),
                                           model={"arch": arch})
        per_round[k] = (sum(rs["client steps"].values()) * k, rs["client steps"].get(op_count.READ, 0) * k,
                        rs["batched reads"] * k)
    (ops2, reads2, batched2), (ops6, reads6, batched6) = per_round[2], per_round[6]
    assert ops6 <= 1.08 * ops2, (method, ops2, ops6)  # issue: <= 1.2x at 10 vs 40; 1.09x with dropout before
    assert reads6 == reads2 == 0 and batched6 == pytest.approx(batched2), (method, per_round)
