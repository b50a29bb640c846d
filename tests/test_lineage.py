"""Long training keeps bounded task history: weights re-keyed every ``lineage_steps``."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dask_ipar import SGD, Dense, Sequential
from dask_ipar.runtime.lineage import fold_finished_groups


def _model(steps_between_cuts):
    m = Sequential([Dense(11, "relu"), Dense(7, "tanh"), Dense(3)], input_dim=9,
                   dtype="float64", seed=3)
    m.lineage_steps = steps_between_cuts
    return m


def _records(client, uid):
    """Task records mentioning the model on each worker and on the scheduler."""
    def on_worker(dask_worker=None):
        return sum(uid in str(k) for k in dask_worker.state.tasks)

    def on_scheduler(dask_scheduler=None):
        return sum(uid in str(k) for k in dask_scheduler.tasks)

    return max(client.run(on_worker).values()), client.run_on_scheduler(on_scheduler)


def _train(client, model, steps):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((40, 9))
    y = rng.integers(0, 3, 40)
    opt = SGD(lr=0.05, momentum=0.9, weight_decay=1e-3)
    model.distribute(client, "2x2")
    for s in range(steps):
        idx = slice(8 * (s % 5), 8 * (s % 5) + 8)
        client.gather(model.train_step(X[idx], y[idx], opt))


@pytest.mark.parametrize("executor, per_step", [("graph", 8), ("programs", 2)])
def test_rekeyed_training_equals_uncut_training_and_forgets_past_steps(client, executor,
                                                                     per_step):
    steps = 25
    cut, uncut = _model(3), _model(None)
    cut.executor = uncut.executor = executor
    try:
        _train(client, cut, steps)
        _train(client, uncut, steps)
        for (wa, ba), (wb, bb) in zip(cut.get_weights(), uncut.get_weights()):
            assert np.array_equal(wa, wb) and np.array_equal(ba, bb)  # bit for bit
        kept_uncut, sched_uncut = _records(client, uncut.uid)
        # the workers forget a released key when the scheduler's message reaches them:
        # on a loaded machine that can lag the gathered step by a moment
        deadline = time.monotonic() + 10
        while True:
            kept_cut, sched_cut = _records(client, cut.uid)
            if kept_cut <= kept_uncut / 2 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        # without cuts every worker keeps records of every past step (~8 per step of the
        # 2x2 graph, 2-3 as programs: its two programs and its loss statistics; the new
        # weights stay in the programs' results); with cuts (lineage_steps = 3: at the
        # first settled state after 3 steps, at the latest after 6, so on a loaded
        # machine every 6: CI kept 21 of 35 records in 13 steps) at most the last 5
        # steps' records remain, well under half of 25 steps' records
        assert kept_uncut >= per_step * steps
        assert kept_cut <= kept_uncut / 2
        assert sched_cut <= sched_uncut + 8  # the scheduler's own count stays as small

        def span_groups(dask_scheduler=None, uid=None):
            ext = dask_scheduler.extensions["spans"]
            return sum(uid in tg.name for s in ext.spans.values() for tg in s.groups)

        # the fold keeps the spans' groups of the model bounded too: without it the cut
        # model would have as many as the uncut one (2-3 a step) and more (its re-keyed
        # blocks'); with it at least one a step fewer
        assert client.run_on_scheduler(span_groups, uid=cut.uid) <= \
            client.run_on_scheduler(span_groups, uid=uncut.uid) - steps
    finally:
        cut.close()
        uncut.close()


def test_cut_waits_for_steps_in_flight(client):
    """A cut while steps are still running (fit keeps two in flight) changes nothing."""
    rng = np.random.default_rng(1)
    X = rng.standard_normal((64, 9))
    y = rng.integers(0, 3, 64)
    a, b = _model(2), _model(None)
    try:
        for m in (a, b):
            m.distribute(client, "2x2")
            m.fit(X, y, epochs=2, batch_size=8, optimizer=SGD(lr=0.05, momentum=0.9),
                  shuffle=False, max_inflight=2, measure=False)
        # 16 steps, one a submission: mid-epoch each pushes its new weights ahead to the
        # next, so no state is settled and a cut is due only after 2 x 2 steps (before
        # steps 5, 9 and 13; the one before 9 also after the epoch's end)
        assert a._cuts == 3 and b._cuts == 0
        for (wa, ba), (wb, bb) in zip(a.get_weights(), b.get_weights()):
            assert np.array_equal(wa, wb) and np.array_equal(ba, bb)
    finally:
        a.close()
        b.close()


def test_fold_finished_groups_keeps_span_totals():
    """Folding is exact: a span's duration, bytes and state counts do not change."""
    from distributed.scheduler import TaskGroup, TaskPrefix
    from distributed.spans import Span

    prefix = TaskPrefix("dense0.act")
    span = Span(("dask-ipar", "dense0", "forward"), "id0", None, [(0.0, 1)])
    for s in range(5):
        tg = TaskGroup(f"dense0.act-abc123-s{s}", prefix)
        tg.states["forgotten"] = 4
        tg._size = 4
        tg.nbytes_total = 1000 * (s + 1)
        tg.add_duration("compute", 10.0 + s, 10.5 + s)
        tg.add_type("numpy.ndarray")
        tg.span_id = "id0"
        span.groups.add(tg)
    live = TaskGroup("dense0.act-abc123-s5", prefix)  # a group with tasks: never folded
    live.states["memory"] = 4
    live._size = 4
    span.groups.add(live)
    other = TaskGroup("dense0.act-ffffff-s0", prefix)  # another model's: left alone
    other.states["forgotten"] = 1
    span.groups.add(other)
    span.add_metadata({"collections": [{"type": "low-level-graph"}]})
    for _ in range(4):
        span.add_metadata({"collections": [{"type": "low-level-graph"}]})

    class Ext:
        spans = {"id0": span}

    class Sched:
        task_groups = {live.name: live}
        extensions = {"spans": Ext()}
        computations = []

    before = (span.duration, span.nbytes_total, dict(span.states), span.start, span.stop,
              dict(span.all_durations))
    assert fold_finished_groups("abc123", dask_scheduler=Sched()) == 4
    after = (span.duration, span.nbytes_total, dict(span.states), span.start, span.stop,
             dict(span.all_durations))
    assert before == after
    assert len(span.groups) == 3 and live in span.groups and other in span.groups
    assert span.metadata["collections"] == [{"type": "low-level-graph"}]
    assert fold_finished_groups("abc123", dask_scheduler=Sched()) == 0  # nothing new


def test_cut_names_never_repeat_across_distribute(client):
    """The count of cuts lives as long as the model: after moving to another grid, new cut
    names do not reuse those of blocks a caller may still hold."""
    m = _model(2)
    try:
        # a cut is due after 2 steps where the state is settled, after 4 at the latest
        _train(client, m, 9)
        before, names = m._cuts, set(m._w)
        assert before >= 2
        m.distribute(client, "1x2")
        assert m._cuts == before
        rng = np.random.default_rng(1)
        X, y = rng.standard_normal((8, 9)), rng.integers(0, 3, 8)
        for _ in range(5):
            client.gather(m.train_step(X, y, SGD(lr=0.05)))
        assert m._cuts > before
        assert not names & set(m._w)
    finally:
        m.close()


def test_the_state_is_settled_only_when_its_holders_finished_and_nothing_went_ahead(client):
    """``BlockStore.settled`` (when a due lineage cut waits for nothing): False while a
    block's holder runs or a block was pushed ahead to the next step's programs."""
    m = _model(None)
    try:
        m.distribute(client, "2x2")
        store = m._store
        assert store.settled()  # scattered weights, nothing in flight
        key = (store.w[0], 0, 0)
        slow = client.submit(time.sleep, 3, pure=False)
        store.hold({key: slow})
        assert not store.settled()  # its holding program still runs
        slow.result()
        assert store.settled()
        store.hold({key: slow}, {key: ("somewhere",)})
        assert not store.settled()  # pushed ahead: a rename would strand it
    finally:
        m.close()
