"""Several training steps per submission (``fit(steps_per_program=k)``): the same floats as
one step at a time, on any grid, optimizer and executor; submissions end where callbacks
read the state and at every epoch's end."""

from __future__ import annotations

import numpy as np
import pytest

from dask_ipar import SGD, Adam, Dense, Sequential
from dask_ipar.errors import IparError
from dask_ipar.optim import StepLR
from dask_ipar.runtime import steps as S
from dask_ipar.runtime.loop import Callback


class SyncAt(Callback):
    """Reads the state after step ``at`` (as a checkpoint every ``at`` steps would)."""

    def __init__(self, at):
        self.at, self.seen = at, []

    def wants_sync(self, loop, step):
        return step == self.at

    def on_sync(self, loop, step):
        self.seen.append((step, loop._submitted))


def _train(client, grid, k, optimizer, executor="programs", callbacks=()):
    rng = np.random.default_rng(7)
    X = rng.standard_normal((5 * 11 + 3, 19))  # 5 steps per epoch, the last one 14 samples
    y = rng.integers(0, 6, X.shape[0])
    model = Sequential([Dense(13, "relu"), Dense(17, "tanh"), Dense(6)], input_dim=19,
                       dtype="float64", seed=5).distribute(client, grid)
    model.executor = executor
    submissions = []  # the first step of each submission (built afresh or replayed)
    done = S._submitted

    def counting(m, batches, *args):
        if m is model:
            submissions.append(m._step - len(batches) + 1)
        return done(m, batches, *args)

    S._submitted = counting
    try:
        h = model.fit(X, y, epochs=2, batch_size=11, optimizer=optimizer,
                      steps_per_program=k, callbacks=list(callbacks))
        return model.get_weights(), [s.loss for s in h.steps], submissions
    finally:
        S._submitted = done
        model.close()


@pytest.mark.parametrize("grid,optimizer,executor", [
    ("2x2", SGD(lr=0.1, momentum=0.9, weight_decay=0.01, schedule=StepLR(3, 0.5)), "programs"),
    ("3x1", SGD(lr=0.05, momentum=0.9, nesterov=True, clip_norm=0.5), "programs"),
    ("1x3", Adam(lr=0.01), "programs"),
    ("2x2", Adam(lr=0.01, clip_norm=1.0), "graph"),
])
def test_several_steps_per_program_equal_one_at_a_time_bit_for_bit(client, grid, optimizer,
                                                                   executor):
    w1, loss1, subs1 = _train(client, grid, 1, optimizer, executor)
    sync = SyncAt(4)
    w3, loss3, subs3 = _train(client, grid, 3, optimizer, executor, [sync])
    assert loss3 == loss1 and len(loss1) == 10
    for (a, b), (c, d) in zip(w1, w3):
        assert np.array_equal(a, c) and np.array_equal(b, d)
    assert len(subs1) == 10
    # steps 1-3 | 4 (read after it) | 5 (epoch end) | 6-8 | 9-10 (epoch end)
    assert np.diff(subs3).tolist() == [3, 1, 1, 3], subs3
    assert sync.seen == [(4, 4)]  # every step up to 4 submitted and done, none after


@pytest.mark.parametrize("bad", [0, 17, 2.5, True, "4"])
def test_bad_steps_per_program_is_refused(client, bad):
    model = Sequential([Dense(4)], input_dim=3).distribute(client, "1x1")
    try:
        with pytest.raises(IparError, match=r"steps_per_program must be a whole number from 1 "
                                            r"to 16 or .auto., got"):
            model.fit(np.zeros((8, 3)), np.zeros(8, dtype=int), batch_size=4,
                      steps_per_program=bad)
    finally:
        model.close()


def test_auto_groups_the_steps_of_small_models_only(client):
    """``"auto"``: 16 steps per submission for a tiny MLP (microseconds of compute a step),
    1 for a model whose step computes for seconds; fit uses what it picks."""
    from dask_ipar.runtime.steps import auto_steps_per_program

    class Seen(Callback):
        def on_train_begin(self, loop):
            self.k = loop.steps_per_program

    small = Sequential([Dense(16, "relu"), Dense(4)], input_dim=8).distribute(client, "2x1")
    big = Sequential([Dense(2048, "relu"), Dense(2048, "relu"), Dense(10)],
                     input_dim=2048).distribute(client, "2x1")
    try:
        assert auto_steps_per_program(small, 32, SGD()) == 16
        assert auto_steps_per_program(big, 4096, SGD()) == 1
        seen = Seen()
        small.fit(np.zeros((64, 8)), np.zeros(64, dtype=int), batch_size=32,
                  steps_per_program="auto", callbacks=[seen])
        assert seen.k == 16
    finally:
        small.close()
        big.close()


@pytest.mark.parametrize("round_s", [0.0, 0.05, 5.0])
def test_auto_with_a_machine_groups_until_a_submission_costs_two_percent(client, round_s):
    """With a calibrated machine, ``"auto"`` also groups a large model's steps: the fewest
    per submission at which what a submission costs beyond its steps (by the step model:
    one step a submission against many) is at most 2% of a step, a submission at most 8 s;
    fit runs what it picks."""
    import os

    from dask_ipar.cost import Machine
    from dask_ipar.runtime.steps import (AUTO_LONGEST_S, AUTO_OVERHEAD,
                                         auto_steps_per_program)
    from dask_ipar.runtime.workers import shared_cores

    class Seen(Callback):
        def on_train_begin(self, loop):
            self.k = loop.steps_per_program

    machine = Machine(alpha_s=1e-3, bandwidth_Bps=1e9, word_bytes=4, flops_per_s=5e10,
                      message_s=1e-4, round_s=round_s)
    big = Sequential([Dense(1024, "relu"), Dense(1024, "relu"), Dense(10)],
                     input_dim=1024).distribute(client, "2x1")
    try:
        cores = shared_cores(client, big.binding.workers)  # this test's LocalCluster
        assert cores == len(os.sched_getaffinity(0))
        k = auto_steps_per_program(big, 2048, SGD(), machine, cores)
        step = {j: big.predict_step_s(2048, machine, cores=cores,
                                      steps_per_program=j).seconds for j in range(1, 17)}
        # the model is linear in 1/k: step(j) = own + submission / j
        submission = (step[1] - step[16]) * 16 / 15
        own = step[1] - submission
        for j in range(2, 17):
            assert step[j] == pytest.approx(own + submission / j, rel=1e-6), j
        assert 1 <= k <= 16
        lasts = k * own + submission  # a submission of k steps
        assert k == 1 or lasts <= AUTO_LONGEST_S + 1e-9
        more_fit = k < 16 and (k + 1) * own + submission <= AUTO_LONGEST_S
        assert not more_fit or submission / k <= AUTO_OVERHEAD * own * (1 + 1e-9)
        assert k == 1 or submission / (k - 1) > AUTO_OVERHEAD * own
        if round_s == 5.0:  # 5 s a submission: as many steps as the 8 s leave room for
            assert 1 < k < 16 and not more_fit, (k, own, submission)
        if round_s == 0.0:
            assert submission < 0.1 * own  # what is left: the last step's push
        seen = Seen()
        X = np.random.default_rng(0).standard_normal((2048, 1024))
        big.fit(X, np.zeros(2048, dtype=int), batch_size=2048, steps_per_program="auto",
                machine=machine, callbacks=[seen], measure=False)
        assert seen.k == k
        # where the step model is not consulted, or cannot run, the rule without it
        rough = auto_steps_per_program(big, 2048, SGD())
        assert rough == 1
        assert auto_steps_per_program(big, 2048, SGD(), machine.replace(flops_per_s=None),
                                      cores) == rough
        assert auto_steps_per_program(big, 2048, SGD(), machine.replace(
            background_cores=4.0), 2) == rough  # no core left to the step: unpriceable
        big.executor = "graph"
        assert auto_steps_per_program(big, 2048, SGD(), machine, cores) == rough
    finally:
        big.close()


def test_a_submissions_losses_come_as_one_block_per_worker(client):
    """Several steps: one loss future per worker of grid row 0 for all of them (not one per
    worker and step), each step reading its row; the values are the one-step ones."""
    from dask_ipar.runtime.steps import StepLosses, gather_losses, submit_steps

    rng = np.random.default_rng(3)
    X = rng.standard_normal((3 * 8, 5))
    y = rng.integers(0, 4, X.shape[0])
    opt = SGD(lr=0.1, momentum=0.9)
    got = {}
    for k in (1, 3):
        model = Sequential([Dense(6, "relu"), Dense(4)], input_dim=5, dtype="float64",
                           seed=2).distribute(client, "2x2")
        try:
            batches = [(X[8 * s:8 * s + 8], y[8 * s:8 * s + 8], opt) for s in range(3)]
            parts = [p for n in range(0, 3, k) for p in submit_steps(model, batches[n:n + k])]
            if k == 3:
                assert all(isinstance(p, StepLosses) for p in parts)
                assert len({id(p.losses) for p in parts}) == 1
                assert len(parts[0].losses.futures) == 2  # grid row 0 of 2x2: two workers
            else:
                assert all(isinstance(p, list) and len(p) == 2 for p in parts)
            got[k] = [np.asarray(gather_losses(model._store, p, s + 1)).tolist()
                      for s, p in enumerate(parts)]
        finally:
            model.close()
    assert got[3] == got[1]


def test_collector_paused_restores_the_collector_as_it_was():
    import gc

    from dask_ipar.runtime.collector import collector_paused

    was = gc.isenabled()
    try:
        for start in (True, False):
            (gc.enable if start else gc.disable)()
            with collector_paused():
                assert not gc.isenabled()
            assert gc.isenabled() == start
            with pytest.raises(KeyError), collector_paused():
                raise KeyError("x")
            assert gc.isenabled() == start
            with collector_paused():  # nested (a worker's programs overlap)
                with collector_paused():
                    assert not gc.isenabled()
                assert not gc.isenabled()
            assert gc.isenabled() == start
    finally:
        (gc.enable if was else gc.disable)()


def _exchange_log(dask_worker=None):
    from dask_ipar.runtime.exchange import drain_exchange_log

    return [(s, r, [k for k, _ in keys]) for s, r, _, keys in drain_exchange_log(
        dask_worker=dask_worker)]


def test_next_steps_weight_slices_of_every_layer_go_as_one_message(client):
    """A program of several steps holds the small updated weight slices that only the next
    step reads until its step is done: per peer and step one message with every layer's
    slices (not one per layer), and the run stays bit-equal to one step at a time (the
    tests above)."""
    rng = np.random.default_rng(1)
    X = rng.standard_normal((32, 19))
    y = rng.integers(0, 6, 32)
    model = Sequential([Dense(13, "relu"), Dense(17, "tanh"), Dense(6)], input_dim=19,
                       dtype="float64", seed=5).distribute(client, "2x2")
    try:
        client.run(_exchange_log)
        model.fit(X, y, epochs=1, batch_size=8, optimizer=SGD(lr=0.1, momentum=0.9),
                  steps_per_program=4, measure=False, shuffle=False)
        msgs = [m for log in client.run(_exchange_log).values() for m in log]
    finally:
        model.close()
    per = {}  # (sender, receiver, step) -> messages with updated weight slices of that step
    for sender, receiver, keys in msgs:
        for step in {int(k[0].rpartition("-s")[2]) for k in keys if ".w-" in k[0]}:
            layers = {k[0].split(".")[0] for k in keys
                      if k[0].endswith(f".w-{model.uid}-s{step}")}
            per.setdefault((sender, receiver, step), []).append(layers)
    inside = {k: v for k, v in per.items() if k[2] < 4}  # read by the submission's next step
    assert inside and {s for _, _, s in inside} == {1, 2, 3}, per
    for where, messages in inside.items():
        assert messages == [{"dense0", "dense1", "dense2"}], (where, messages)


def test_new_weights_stay_in_the_programs_results_until_something_reads_them(client):
    """With worker programs a step's new weight blocks get no task of their own: the next
    submission's programs take them from the results of the programs that made them, and
    anything else (here get_weights) gets their tasks first; the weights equal the task
    graph executor's, where every block is a task."""
    from dask_ipar.runtime.steps import submit_steps

    rng = np.random.default_rng(4)
    X = rng.standard_normal((4 * 8, 5))
    y = rng.integers(0, 4, X.shape[0])
    opt = SGD(lr=0.1, momentum=0.9)
    batches = [(X[8 * s:8 * s + 8], y[8 * s:8 * s + 8], opt) for s in range(4)]
    got = {}
    for executor in ("graph", "programs"):
        model = Sequential([Dense(6, "relu"), Dense(4)], input_dim=5, dtype="float64",
                           seed=2).distribute(client, "2x2")
        model.executor = executor
        try:
            for n in (0, 2):
                submit_steps(model, batches[n:n + 2])
                store = model._store
                keys = [(name, i, j) for name in store.w for i, j in [(0, 0), (1, 1)]]
                if executor == "programs":
                    assert all(store.held_key(k)[0].startswith("step.run") for k in keys)
                    known = client.run_on_scheduler(
                        lambda dask_scheduler, keys=keys: [k in dask_scheduler.tasks
                                                           for k in keys])
                    assert known == [False] * len(keys)
                else:
                    assert all(store.held_key(k) is None for k in keys)
            got[executor] = model.get_weights()
            assert all(model._store.held_key(k) is None for k in keys)  # tasks of their own
        finally:
            model.close()
    for (a, b), (c, d) in zip(got["graph"], got["programs"]):
        assert np.array_equal(a, c) and np.array_equal(b, d)


def test_resume_of_a_multi_step_run_on_an_uneven_grid_is_bit_equal(client, tmp_path):
    """Three steps per submission with a checkpoint every four steps on 3x2 (blocks that
    do not divide the widths or the batch): resumed from each mid-run checkpoint, the run
    ends with the weights of the uninterrupted one, which equal one step at a time."""
    import os
    import shutil

    pytest.importorskip("zarr")
    from dask_ipar.io import checkpoint as ck
    from dask_ipar.io.checkpoint import Checkpointing
    from dask_ipar.runtime.loop import BatchPlan, TrainLoop
    from dask_ipar.runtime.training import prepare

    opt = SGD(lr=0.05, momentum=0.9, weight_decay=1e-3)
    rng = np.random.default_rng(0)
    X0, y0 = rng.standard_normal((60, 9)), rng.integers(0, 5, 60)

    def run(directory, k, seed=0):
        m = Sequential([Dense(13, "relu"), Dense(11, "tanh"), Dense(5)], input_dim=9,
                       dtype="float64", seed=seed).distribute(client, "3x2")
        try:
            X, y, b = prepare(m, X0, y0, 10)
            TrainLoop(m, X, y, BatchPlan(X.shape[0], b, 0), opt, total_steps=12,
                      callbacks=[Checkpointing(directory, every=4, keep=None)],
                      steps_per_program=k).run()
            return m.get_weights()
        finally:
            m.close()

    def same(a, b):
        return all(np.array_equal(p, q) for x, z in zip(a, b) for p, q in zip(x, z))

    one = run(tmp_path / "k1", 1)
    full = run(tmp_path / "full", 3)
    assert same(one, full)
    mid = ck.checkpoints(tmp_path / "full")[1:-1]
    assert [s for s, _ in mid] == [4, 8]
    for step, path in mid:
        d = tmp_path / f"from{step}"
        d.mkdir()
        shutil.copytree(path, d / os.path.basename(path))
        assert same(run(d, 3, seed=99), full), f"resumed at step {step}"
