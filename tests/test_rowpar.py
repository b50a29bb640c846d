"""The row-parallel output layer (nn/rowpar.py): the reference's values on every grid with
Pr > 1, for every optimizer and with clipping, the cost model's bytes, and the decision."""

from __future__ import annotations

import numpy as np
import pytest

from dask_ipar import SGD, Adam, Dense, Sequential
from dask_ipar.cost import FC, Machine, dense_layer_phases, row_parallel_output, row_parallel_phases
from dask_ipar.cost import rowpar as cost_rowpar
from dask_ipar.layout.grid import Grid
from dask_ipar.testing import check_mlp, step_graph


#: The test network: 5 classes (at least Pr on every grid), B = 37 (the whole W and its
#: gradient partial take no more memory than the gathered input on every grid here)
SIZES = (37, 29, 13, 5)


def _layers():
    return [Dense(29, "relu"), Dense(13, "tanh"), Dense(5)]


@pytest.fixture
def forced(monkeypatch):
    """Row-parallel wherever it may run (the small test networks save few words), with a
    spy that counts the graphs built so."""
    from dask_ipar.nn import rowpar

    monkeypatch.setattr(cost_rowpar, "ROW_PARALLEL_MIN_WORDS", -(10 ** 12))
    made = {"n": 0}
    real = rowpar.forward

    def spy(*a, **k):
        made["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(rowpar, "forward", spy)
    return made


@pytest.mark.parametrize("grid,executor", [("2x1", "programs"), ("4x1", "programs"),
                                           ("3x2", "programs"), ("4x2", "programs"),
                                           ("2x3", "programs"), ("2x2", "graph"),
                                           ("3x1", "graph")], ids=str)
def test_row_parallel_matches_reference(client, forced, grid, executor):
    # 37-29-13-5, B = 37, float64: logits, gradients, finite differences, 4 SGD steps
    errors = check_mlp(client, grid, sizes=SIZES, batch=37, steps=4, executor=executor)
    assert forced["n"] > 0
    assert errors["finite_difference"] < 1e-6
    assert max(v for k, v in errors.items() if k.startswith(("dW", "db"))) <= 1e-12
    rows = {(r.layer, r.phase): r for r in errors["comm"].rows}
    # the layer in front sends nothing forward; the output layer no input gradient
    assert rows[("dense1", "fwd_gather")].measured_bytes == 0
    assert rows[("dense2", "dx_reduce")].measured_bytes == 0
    assert rows[("dense2", "fwd_gather")].measured_bytes > 0
    assert all(abs(r.ratio - 1) <= 0.02 for r in errors["comm"].rows)


@pytest.mark.parametrize("optimizer", [SGD(lr=0.05, momentum=0.9, nesterov=True),
                                       Adam(lr=0.01, weight_decay=0.01),
                                       SGD(lr=0.1, momentum=0.9, clip_norm=0.5)], ids=str)
def test_row_parallel_optimizers_match_the_1p5d_layer(client, monkeypatch, optimizer):
    """Nesterov, Adam and clipped SGD on the row-parallel layer end where the 1.5D layer
    does (the same steps on the same grid, the decision switched off), with the form
    changing from step to step (the state and weights go from one to the other)."""
    X = np.random.default_rng(0).standard_normal((46, 37))
    y = np.random.default_rng(1).integers(0, 5, 46)

    def run():
        model = Sequential(_layers(), input_dim=37, dtype="float64", seed=3)
        model.distribute(client, "2x2")
        try:
            # batches of 37 and 9: the last batch's step runs the 1.5D layer (a whole W per
            # cell would outweigh its gathered input), so the form changes every step
            model.fit(X, y, epochs=3, batch_size=37, optimizer=optimizer, shuffle=False,
                      diverge_factor=0)
            return model.get_weights()
        finally:
            model.close()

    from dask_ipar.nn import rowpar as graphs

    made, real = [], graphs.forward
    monkeypatch.setattr(graphs, "forward", lambda *a, **k: made.append(1) or real(*a, **k))
    plain = run()
    assert not made
    monkeypatch.setattr(cost_rowpar, "ROW_PARALLEL_MIN_WORDS", -(10 ** 12))
    rowpar = run()
    assert made  # the batches of 37 (step templates build a graph once and replay it)
    assert not row_parallel_output(13, 5, True, 2, 2, 9, after_dense=True)  # the last: 1.5D
    for (wa, ba), (wb, bb) in zip(plain, rowpar):
        np.testing.assert_allclose(wb, wa, rtol=1e-11, atol=1e-13)
        np.testing.assert_allclose(bb, ba, rtol=1e-11, atol=1e-13)


def test_graph_routes_equal_the_phases(monkeypatch):
    """Every grid up to P = 8: the words the graph routes per layer and phase equal
    row_parallel_phases (and dense_layer_phases without the output gather in front)."""
    monkeypatch.setattr(cost_rowpar, "ROW_PARALLEL_MIN_WORDS", -(10 ** 12))
    batch = 37
    for pr, pc in [(2, 1), (3, 1), (4, 1), (2, 2), (3, 2), (4, 2), (2, 3)]:
        model = Sequential(_layers(), input_dim=37, dtype="float64")
        _, g = step_graph(model, Grid(pr, pc), batch)
        routed = g.routed_words()
        m = Machine(word_bytes=8)
        want = (dense_layer_phases(FC(29, 13), pr, pc, batch, m, first_layer=False,
                                   gather_output=False, name="dense1")
                + row_parallel_phases(FC(13, 5), pr, pc, batch, m, name="dense2"))
        for p in want:
            assert routed.get((p.layer, p.phase), 0) * 8 == p.total_bytes, (pr, pc, p)
        assert routed.get(("dense1", "fwd_gather"), 0) == 0
        assert ("dense2", "dx_reduce") not in routed


def test_decision():
    # the compute-bound MLP's classifier on 8 x 1: 59 M words as 1.5D, 1.1 M row-parallel
    assert row_parallel_output(4096, 10, True, 8, 1, 1024, after_dense=True)
    assert row_parallel_output(4096, 10, True, 4, 2, 1024, after_dense=True)
    # not on pure batch, not as the first dense layer, not for a batch not known
    assert not row_parallel_output(4096, 10, True, 1, 8, 1024, after_dense=True)
    assert not row_parallel_output(4096, 10, True, 8, 1, 1024, after_dense=False)
    assert not row_parallel_output(4096, 10, True, 8, 1, None, after_dense=True)
    # a wide last layer stays 1.5D: its weights outweigh the activations
    assert not row_parallel_output(512, 4096, True, 4, 1, 64, after_dense=True)
    # the tiny MLP (64-wide, B = 64, 2 x 2) saves too few words to pay for the messages
    assert not row_parallel_output(64, 10, True, 2, 2, 64, after_dense=True)
    # a whole W per cell heavier than the gathered input it replaces: not, however forced
    assert not row_parallel_output(4096, 10, True, 8, 1, 16, after_dense=True)


def test_planner_prices_the_form_the_engine_runs():
    """The planner (both searches) and engine_layer_phases charge the row-parallel phases
    to the classifier and nothing to the gather in front of it."""
    from dask_ipar.cost import engine_layer_phases, plan

    layers = [FC(4096, 4096, name="fc0"), FC(4096, 4096, name="fc1"), FC(4096, 10, name="fc2")]
    m = Machine()
    want = row_parallel_phases(layers[2], 8, 1, 1024, m, name="fc2")
    for schemes in (None, ("model",)):
        res = plan(layers, 8, 1024, m, schemes=schemes)
        grid = next(g for g in res.feasible if (g.pr, g.pc) == (8, 1))
        got = {(p.layer, p.phase): p.total_bytes for p in grid.phases}
        assert all(got[("fc2", p.phase)] == p.total_bytes for p in want), schemes
        assert got[("fc1", "fwd_gather")] == 0
    # a layer whose successors are not given is priced as Eq. 8
    alone = engine_layer_phases(layers[2], "dense", "dense", 8, 1, 1024, m)
    assert {p.phase: p.total_bytes for p in alone}["dx_reduce"] > 0


@pytest.mark.parametrize("activation", ["linear", "relu", "tanh"])
def test_kernels_sum_to_the_whole_layer(activation):
    """The partials over two row blocks of the input, summed, are the layer; the input
    gradient of each block and the sum of the weight-gradient partials are the whole
    layer's. NumPy and array_api_strict give the same values (array-API generic)."""
    xps = pytest.importorskip("array_api_strict")
    from dask_ipar.kernels import rowpar as KR
    from dask_ipar.kernels.dense import _activate

    rng = np.random.default_rng(0)
    w, x, dz = rng.standard_normal((4, 8)), rng.standard_normal((7, 3)), rng.standard_normal((4, 3))
    a = np.tanh(rng.standard_normal((7, 3)))
    cuts = [(0, 3), (3, 7)]
    for xp in (np, xps):
        W, X, DZ, A = (xp.asarray(v) for v in (w, x, dz, a))
        parts = [KR.partial_forward(c0, c1, W, X[c0:c1, :], None) for c0, c1 in cuts]
        out = KR.partial_sum(7, True, activation, W, *parts)
        want = _activate(w[:, :7] @ x + w[:, 7:8], activation)
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-13)
        assert out is not parts[0]  # a fresh array: the partials are other tasks' results
        for c0, c1 in cuts:
            got = KR.dz_rows(A[c0:c1, :], "tanh", c0, c1, W, DZ)
            np.testing.assert_allclose(np.asarray(got),
                                       (w[:, c0:c1].T @ dz) * (1 - a[c0:c1] ** 2), rtol=1e-13)
        grads = [KR.grad_partial(c0, c1, 8, k == len(cuts) - 1, DZ, X[c0:c1, :])
                 for k, (c0, c1) in enumerate(cuts)]
        assert all(gp[0] is None for gp in grads)
        total = np.asarray(grads[0][1]) + np.asarray(grads[1][1])
        np.testing.assert_allclose(total[:, :7], dz @ x.T, rtol=1e-13)
        np.testing.assert_allclose(total[:, 7], dz.sum(axis=1), rtol=1e-13)


@pytest.mark.parametrize("grid", ["4x1", "3x1"])
def test_row_parallel_run_resumed_after_a_killed_worker_is_bit_equal(client4, forced, tmp_path,
                                                                     grid):
    """A worker killed mid-run, the run resumed from its checkpoint: the same float64 bits
    as the uninterrupted run, with the last layer row-parallel on grids that split its 9
    inputs and 5 outputs unevenly (the checkpoint test's network and checks)."""
    from tests.test_checkpoint import test_worker_killed_at_a_random_step_resumes_exactly as run

    rng = np.random.default_rng(42)
    run(client4, (rng.standard_normal((48, 7)), rng.integers(0, 5, 48)), tmp_path, grid, 100)
    assert forced["n"] > 0
