"""Every block of a training step runs, and stays, on the worker of its grid cell."""

from __future__ import annotations

import numpy as np
import pytest

from distributed import get_task_stream

from dask_ipar import SGD, Dense, Sequential
from dask_ipar.nn.graph import StepGraph


@pytest.mark.parametrize("grid", ["2x2", "3x2", "1x4", "4x1"])
def test_every_task_of_a_step_runs_on_its_cell(client, grid):
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((23, 37)), rng.integers(0, 10, 23)
    model = Sequential([Dense(29, "relu"), Dense(13, "tanh"), Dense(10)], input_dim=37,
                       dtype="float64").distribute(client, grid)
    model.fit(X, y, epochs=1, batch_size=23)  # warm up: step 0 weights exist
    step = model._next_step()
    g = StepGraph()
    x_keys, y_keys, _ = model._place_batch(X, y, step, g)
    g, new_w, new_v, stats = model.engine.train_step(
        x_keys, y_keys, 23, model._w, model._v, step, 0.1, 0.9, 0.0, g=g)
    keys = [(n, i, j) for n in new_w + new_v for i, j in model.binding.grid.cells()]
    with get_task_stream(client=client) as ts:
        futs = model._submit(g, "placement-check", keys + stats)
        client.gather(futs)
    ran = {}
    for rec in ts.data:
        key = rec["key"]
        ran[key if not isinstance(key, list) else tuple(key)] = rec["worker"]
    computed = {k for k in g.dsk if not k[0].startswith("input.")}
    assert computed <= set(ran), f"tasks missing from the task stream: {computed - set(ran)}"
    wrong = {k: (ran[k], g.place[k]) for k in computed if ran[k] != g.place[k]}
    assert not wrong, f"tasks ran off their grid cell: {wrong}"
    # and the new state lives where the scheduler says it should
    who = client.who_has(futs[: len(keys)])
    for k in keys:
        assert tuple(who[k]) == (model.binding.worker(*k[1:]),), (k, who[k])
    # every cell of the grid ran some of the step
    assert set(ran.values()) == set(model.binding.workers)
    model.close()


def test_weight_blocks_are_dask_arrays_on_their_cells(client):
    model = Sequential([Dense(7, "relu"), Dense(5)], input_dim=6, dtype="float64",
                       seed=1).distribute(client, "2x2")
    arrays = model.weight_arrays()
    assert arrays[0].chunks == ((4, 3), (4, 3))  # 7 rows over Pr=2, 6+1 columns over Pc=2
    who = client.who_has(list(model._futures.values()))
    for key, holders in who.items():
        assert tuple(holders) == (model.binding.worker(*key[1:]),)
    for W, (Wn, bn) in zip(arrays, model.get_weights()):
        np.testing.assert_array_equal(W.compute(), np.concatenate([Wn, bn[:, None]], axis=1))
    model.fit(np.ones((4, 6)), np.arange(4), batch_size=4, optimizer=SGD(lr=0.1))
    model.close()


def test_dashboard_spans_per_layer_and_phase(client):
    rng = np.random.default_rng(0)
    model = Sequential([Dense(9, "relu"), Dense(5)], input_dim=6,
                       dtype="float64").distribute(client, "2x2")

    def names(dask_scheduler=None):
        return [s.name for s in dask_scheduler.extensions["spans"].spans.values()]

    # the session's scheduler keeps the spans of earlier tests (their predictions too)
    before = set(client.run_on_scheduler(names))
    model.fit(rng.standard_normal((8, 6)), rng.integers(0, 5, 8), batch_size=8, epochs=2)
    spans = set(client.run_on_scheduler(names))
    for layer in ("dense0", "dense1"):
        for phase in ("forward", "dw_reduce", "update"):
            assert ("dask-ipar", layer, phase) in spans, (layer, phase, sorted(spans))
    # the gathers end inside the forward and loss tasks: a training step has no gather
    # task of a layer; the weight prefetch at the start of a step is a task of its own
    assert ("dask-ipar", "dense1", "fwd_gather") not in spans - before
    assert ("dask-ipar", "weights", "w_gather") in spans
    assert ("dask-ipar", "dense1", "dx_reduce") in spans
    assert ("dask-ipar", "loss", "loss") in spans
    # predictions gather the logits rows on grid row 0: a task of its own
    model.predict(rng.standard_normal((8, 6)))
    assert ("dask-ipar", "dense1", "fwd_gather") in set(client.run_on_scheduler(names))
    model.close()


def test_amm_held_while_a_model_is_distributed(client):
    """Replicas that later tasks of a step read must stay: the AMM is stopped while a
    model is distributed and restored when the last model on the scheduler closes."""
    before = client.amm.running()
    a = Sequential([Dense(5, "relu"), Dense(3)], input_dim=4).distribute(client, "2x2")
    b = Sequential([Dense(5, "relu"), Dense(3)], input_dim=4).distribute(client, "1x2")
    assert not client.amm.running()
    a.close()
    assert not client.amm.running(), "b still trains"
    b.close()
    assert client.amm.running() == before


def test_weights_in_place_only_across_processes(client):
    """Weight blocks are rewritten in place on worker processes; in-process workers (whose
    fetched copies can be the owner's arrays) get new blocks and stay exact."""
    from distributed import Client, LocalCluster

    from dask_ipar.testing import check_mlp

    m = Sequential([Dense(5, "relu"), Dense(3)], input_dim=4).distribute(client, "2x2")
    assert m.engine.weights_in_place
    m.close()
    with LocalCluster(n_workers=4, processes=False, threads_per_worker=1,
                      dashboard_address=None) as cluster, Client(cluster) as c:
        m = Sequential([Dense(5, "relu"), Dense(3)], input_dim=4).distribute(c, "2x2")
        assert not m.engine.weights_in_place
        m.close()
        check_mlp(c, "2x2", steps=4)


def test_in_process_workers_get_copies_of_the_batch():
    """Batch blocks reach worker processes as transposed views of the caller's rows (no copy
    on the client); in-process workers would share the caller's memory, so they get copies:
    a buffer the caller reuses right after submitting a step does not change that step."""
    from distributed import Client, LocalCluster

    from dask_ipar.reference import mlp_loss_and_grads, sgd_step

    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((8, 4)), rng.integers(0, 3, 8)
    with LocalCluster(n_workers=4, processes=False, threads_per_worker=1,
                      dashboard_address=None) as cluster, Client(cluster) as c:
        m = Sequential([Dense(5, "relu"), Dense(3)], input_dim=4,
                       dtype="float64").distribute(c, "2x2")
        params0 = m.get_weights()
        buf = X.copy()
        stats = m.train_step(buf, y, SGD(lr=0.1))
        buf[...] = 1e6  # the caller reuses its buffer at once
        c.gather(stats)
        got = m.get_weights()
        m.close()
    _, _, grads = mlp_loss_and_grads(params0, ["relu", "linear"], X.T, y)
    want, _ = sgd_step(params0, [None, None], grads, 0.1)
    for (W, b), (Wr, br) in zip(got, want):
        np.testing.assert_allclose(W, Wr, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(b, br, rtol=1e-12, atol=1e-14)


def test_distribute_to_another_grid_keeps_the_momentum(client):
    """Training 3 steps on 2x2, moving to 1x4 and training 3 more equals 6 steps on 2x2
    (float64): the momentum comes along, as it does through a checkpoint. Dropping it
    (set_weights resets it) makes a difference the test sees."""
    from dask_ipar import SGD, Dense, Sequential
    from dask_ipar.testing import rel_err

    rng = np.random.default_rng(5)
    X, y = rng.standard_normal((12, 9)), rng.integers(0, 4, 12)
    opt = SGD(lr=0.1, momentum=0.9, weight_decay=1e-3)

    def run(move):
        m = Sequential([Dense(10, "relu"), Dense(4)], input_dim=9, dtype="float64", seed=2)
        m.distribute(client, "2x2")
        for k in range(6):
            if k == 3 and move == "grid":
                m.distribute(client, "1x4")
            if k == 3 and move == "reset":
                m.set_weights(m.get_weights())
            client.gather(m.train_step(X, y, opt))
        out = m.get_weights()
        m.close()
        return out

    ref, moved, reset = run(None), run("grid"), run("reset")
    for (w, b), (wm, bm) in zip(ref, moved):
        assert rel_err(wm, w) <= 1e-10 and rel_err(bm, b) <= 1e-10
    assert max(rel_err(wr, w) for (w, _), (wr, _) in zip(ref, reset)) > 1e-4
