"""New weights pushed ahead: with worker programs a step's new weight blocks go to the
workers that read them in the next step as soon as they exist (``train_step(more=True)``,
``fit`` within an epoch), not when the next step's programs start; the floats and the
bytes stay those of one step at a time."""

from __future__ import annotations

import numpy as np
import pytest
from distributed import wait

from dask_ipar import SGD, Dense, Sequential
from dask_ipar.runtime.exchange import PLUGIN_NAME


def _in_mailbox(keys, dask_worker=None):
    box = dask_worker.plugins[PLUGIN_NAME].box
    return [tuple(k) in box for k in keys]


def _exchange_log(dask_worker=None):
    from dask_ipar.runtime.exchange import drain_exchange_log

    return [(s, r, [k for k, _ in keys]) for s, r, _, keys in drain_exchange_log(
        dask_worker=dask_worker)]


def _model(client, grid, executor):
    model = Sequential([Dense(6, "relu"), Dense(7, "tanh"), Dense(4)], input_dim=5,
                       dtype="float64", seed=2).distribute(client, grid)
    model.executor = executor
    return model


@pytest.mark.parametrize("grid", ["2x2", "1x3"])
def test_new_weights_wait_in_the_readers_mailboxes_before_the_next_step(client, grid):
    """After ``train_step(more=True)`` has run, every new weight block is in the mailbox
    of each worker that read the block it replaces (and nowhere else it is not read), the
    next step's programs send none of them again, and the weights after three steps equal
    the task-graph executor's bit for bit."""
    rng = np.random.default_rng(4)
    X = rng.standard_normal((3 * 8, 5))
    y = rng.integers(0, 4, X.shape[0])
    opt = SGD(lr=0.1, momentum=0.9)
    got = {}
    for executor in ("graph", "programs"):
        model = _model(client, grid, executor)
        try:
            client.run(_exchange_log)
            for s in range(3):
                more = s < 2
                model.train_step(X[8 * s:8 * s + 8], y[8 * s:8 * s + 8], opt, more=more)
                store = model._store
                keys = [(n, i, j) for n in store.w for i, j in model.grid.cells()]
                if executor == "graph":
                    assert all(store.sent_to(k) == () for k in keys)
                    continue
                wait(list(store._held.values()))  # the step's programs have run
                for k in keys:
                    dests = store.sent_to(k)
                    assert bool(dests) == (more and grid != "1x1"), (k, dests)
                    assert model.binding.worker(k[1], k[2]) not in dests
                    if dests:
                        assert all(client.run(_in_mailbox, [k], workers=list(dests)).values())
            if executor == "programs":
                sent = [(r, k) for log in client.run(_exchange_log).values()
                        for _, r, ks in log for k in ks if ".w-" in k[0]]
                assert len(sent) == len(set(sent))  # each block to each reader once
                assert sent, "a grid with Pc > 1 gathers weight slices"
            got[executor] = model.get_weights()
        finally:
            model.close()
    for (a, b), (c, d) in zip(got["graph"], got["programs"]):
        assert np.array_equal(a, c) and np.array_equal(b, d)


def test_blocks_pushed_ahead_are_sent_again_after_an_abort(client):
    """An abort of the model's programs empties its blocks from the mailboxes: the store
    forgets what it pushed ahead, so the next programs send those blocks again."""
    rng = np.random.default_rng(5)
    X, y = rng.standard_normal((8, 5)), rng.integers(0, 4, 8)
    model = _model(client, "1x2", "programs")
    try:
        model.train_step(X, y, SGD(lr=0.1), more=True)
        keys = [(n, i, j) for n in model._store.w for i, j in model.grid.cells()]
        wait(list(model._store._held.values()))
        assert all(model._store.sent_to(k) for k in keys)
        model.abort_programs("test")
        assert not any(model._store.sent_to(k) for k in keys)
    finally:
        model.close()


@pytest.mark.parametrize("grid,k", [("1x3", 1), ("2x2", 1), ("2x2", 3)])
def test_fit_pushes_ahead_within_an_epoch_and_moves_what_the_model_predicts(client, grid, k):
    """``fit`` pushes the new weights ahead within an epoch (not across its end, nor past
    the run's last step): the bytes moved per layer and phase equal the cost model's to
    the byte, and the run equals one step at a time on the task-graph executor."""
    rng = np.random.default_rng(6)
    X = rng.standard_normal((4 * 8, 5))
    y = rng.integers(0, 4, X.shape[0])
    out = {}
    for executor in ("graph", "programs"):
        model = _model(client, grid, executor)
        try:
            h = model.fit(X, y, epochs=2, batch_size=8, shuffle=False,
                          optimizer=SGD(lr=0.1, momentum=0.9), steps_per_program=k)
            rows = h.comm.rows
            assert all(abs(r.ratio - 1) <= 1e-9 for r in rows), [
                (r.layer, r.phase, r.predicted_bytes, r.measured_bytes) for r in rows]
            out[executor] = (model.get_weights(), [s.loss for s in h.steps])
        finally:
            model.close()
    assert out["graph"][1] == out["programs"][1]
    for (a, b), (c, d) in zip(out["graph"][0], out["programs"][0]):
        assert np.array_equal(a, c) and np.array_equal(b, d)
