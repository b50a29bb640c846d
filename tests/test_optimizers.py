"""Adam, AdamW and Nesterov SGD on the grid (issue 18): every step equal to the NumPy
references of :mod:`dask_ipar.reference` (checked against torch.optim in
``tests/test_reference_optim.py``) to 1e-10 in float64, on several grids, for dense and
conv layers; their state sharded beside the weight slices, saved in checkpoints and
carried by ``distribute``; and counted in the planner's memory."""

from __future__ import annotations

import numpy as np
import pytest

from dask_ipar import SGD, Conv2d, Dense, Flatten, IparError, MaxPool2d, Sequential
from dask_ipar import reference as ref
from dask_ipar.io import checkpoint as ck
from dask_ipar.optim import Adam, AdamW, CosineLR
from dask_ipar.runtime.loop import BatchPlan

ACTS = ("tanh", "linear")
OPTIMIZERS = [Adam(0.01, weight_decay=0.01), AdamW(0.02, betas=(0.8, 0.99), weight_decay=0.1),
              SGD(0.05, 0.9, 1e-3, nesterov=True)]
IDS = ["adam", "adamw", "nesterov"]


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(11)
    return rng.standard_normal((40, 7)), rng.integers(0, 5, 40)


def mlp(seed=3):
    # 9 rows over Pr = 2 are 5 + 4; 7 + 1 columns over Pc = 3 are 3 + 3 + 2
    return Sequential([Dense(9, "tanh"), Dense(5)], input_dim=7, dtype="float64", seed=seed)


def reference_run(params, grads_of, plan, steps, opt):
    p = [(W.copy(), None if b is None else b.copy()) for W, b in params]
    state = [None] * len(p)
    for s in range(steps):
        grads = grads_of(p, plan.indices(s))
        lr = opt.lr_at(s)
        if isinstance(opt, SGD):
            p, state = ref.sgd_step(p, state, grads, lr, opt.momentum, opt.weight_decay,
                                    nesterov=opt.nesterov)
        else:
            p, state = ref.adam_step(p, state, grads, lr, opt.betas, opt.eps, opt.weight_decay,
                                     decoupled=opt.decoupled, step=s + 1)
    return p


def max_err(a, b):
    return max(max(np.abs(Wa - Wb).max(), 0.0 if ba is None else np.abs(ba - bb).max())
               for (Wa, ba), (Wb, bb) in zip(a, b))


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=IDS)
@pytest.mark.parametrize("grid", ["2x3", "3x1"])
def test_mlp_steps_equal_the_reference(client, data, opt, grid):
    _two_epochs_equal_the_reference(client, data, opt, grid)


def _two_epochs_equal_the_reference(client, data, opt, grid):
    """Two epochs of ``fit`` (batch 12 of 40) on ``grid``: the reference's weights."""
    X, y = data
    m = mlp().distribute(client, grid)
    params = m.get_weights()
    m.fit(X, y, epochs=2, batch_size=12, optimizer=opt, seed=4)
    plan = BatchPlan(40, 12, 4)

    def grads_of(p, idx):
        return ref.mlp_loss_and_grads(p, ACTS, X[idx].T, y[idx])[2]

    want = reference_run(params, grads_of, plan, 2 * plan.steps_per_epoch, opt)
    assert max_err(m.get_weights(), want) <= 1e-10
    m.close()


@pytest.mark.parametrize("opt,scale", [(OPTIMIZERS[0], 1.0), (OPTIMIZERS[2], 1.0),
                                       (Adam(0.01, clip_norm=0.2), 4.0)],
                         ids=["adam", "nesterov", "adam-clipped"])
def test_cnn_steps_equal_the_reference(client, opt, scale):
    """Conv weights are replicated blocks updated by every cell (their own update path);
    clipped, the norm covers conv and dense gradients alike."""
    rng = np.random.default_rng(2)
    X, y = scale * rng.standard_normal((8, 1, 6, 6)), rng.integers(0, 3, 8)
    layers = [Conv2d(2, 3, activation="relu"), MaxPool2d(2), Flatten(), Dense(3)]
    m = Sequential(layers, input_shape=(1, 6, 6), dtype="float64", seed=1).distribute(client,
                                                                                   "2x2")
    params = m.get_weights()
    m.fit(X, y, epochs=3, batch_size=4, optimizer=opt, seed=0)
    plan = BatchPlan(8, 4, 0)

    def grads_of(p, idx):
        g = ref.cnn_loss_and_grads(layers, p, X[idx], y[idx])[3]
        return g if opt.clip_norm is None else ref.clip_grads(g, opt.clip_norm)[0]

    want = reference_run(params, grads_of, plan, 3 * plan.steps_per_epoch, opt)
    assert max_err(m.get_weights(), want) <= 1e-10
    m.close()


def test_adam_state_in_checkpoints_and_across_grids(client, data, tmp_path):
    """Saved on 2x3 after 3 steps, resumed on 3x1 (another split of every slice): the
    moments and their update count carry over, and the run ends where an uninterrupted
    one does; distribute() carries them too."""
    X, y = data
    opt = AdamW(0.02, weight_decay=0.1, schedule=CosineLR(9))
    plain = mlp().distribute(client, "2x3")
    plain.fit(X, y, epochs=3, batch_size=12, optimizer=opt, seed=4)
    want = plain.get_weights()
    plain.close()
    first = mlp().distribute(client, "2x3")
    first.fit(X, y, epochs=1, batch_size=12, optimizer=opt, seed=4,
              checkpoint=ck.Checkpointing(tmp_path, every=2))
    meta = ck.read_metadata(ck.latest(tmp_path))
    assert meta["optimizer_state"] == "adam" and meta["optimizer_steps"] == 3
    assert meta["version"] == 3  # older releases refuse it as too new, not as damaged
    assert {"dense0/m", "dense0/s"} <= set(meta["arrays"]) and "dense0/v" not in meta["arrays"]
    first.close()
    again = mlp(seed=9).distribute(client, "3x1")
    again.fit(X, y, epochs=3, batch_size=12, optimizer=opt, seed=4,
              checkpoint=ck.Checkpointing(tmp_path, every=2))
    assert max_err(again.get_weights(), want) <= 1e-12
    again.close()
    moved = mlp().distribute(client, "2x3")
    moved.fit(X, y, epochs=1, batch_size=12, optimizer=opt, seed=4)
    moved.distribute(client, "3x1")  # the moments come along
    assert moved._store.opt == ("adam", 3)
    moved.fit(X, y, epochs=3, batch_size=12, optimizer=opt, seed=4)  # steps 0.. again: new rng
    moved.close()


def test_optimizer_kind_cannot_change_silently(client, data):
    X, y = data
    m = mlp().distribute(client, "1x2")
    m.fit(X, y, epochs=1, batch_size=12, optimizer=Adam(0.01))
    with pytest.raises(IparError, match="holds Adam moments.*SGD needs SGD momentum"):
        m.fit(X, y, epochs=1, batch_size=12, optimizer=SGD(0.01))
    m.set_weights(m.get_weights())  # a fresh state: any optimizer
    m.fit(X, y, epochs=1, batch_size=12, optimizer=SGD(0.01))
    m.close()


@pytest.mark.fast
def test_planner_counts_adam_state_twice():
    from dask_ipar.cost import PAPER_MACHINE, layer_memory_bytes
    from dask_ipar.cost.layers import FC

    fc = FC(1000, 500)
    one = layer_memory_bytes(fc, "model", 2, 4, 64, PAPER_MACHINE)
    two = layer_memory_bytes(fc, "model", 2, 4, 64, PAPER_MACHINE, opt_slots=2)
    assert two.optimizer == 2 * one.optimizer > 0
    assert two.total - one.total == one.optimizer
    assert one.optimizer == -(-fc.n_params // 8) * PAPER_MACHINE.word_bytes


@pytest.mark.parametrize("opt", [SGD(0.1, 0.9, 1e-3, clip_norm=0.5),
                                 Adam(0.01, weight_decay=0.01, clip_norm=0.3),
                                 SGD(0.05, 0.9, nesterov=True, clip_norm=0.4)],
                         ids=["sgd", "adam", "nesterov"])
@pytest.mark.parametrize("grid", ["2x2", "1x3"])
def test_clipping_by_global_norm(client, data, opt, grid):
    """Every step's gradients scaled to the global norm first (all layers): the weights
    equal the reference's, and the norm's all-reduce moves exactly the words the cost
    model prices (P (P - 1) words)."""
    from dask_ipar.cost import Machine, grad_norm_phase

    X, y = data
    X = 3 * X  # gradients with norms of about 1-2: every step is clipped
    m = mlp().distribute(client, grid)
    params = m.get_weights()
    h = m.fit(X, y, epochs=2, batch_size=12, optimizer=opt, seed=4)
    plan = BatchPlan(40, 12, 4)
    norms = []

    def grads_of(p, idx):
        g, norm = ref.clip_grads(ref.mlp_loss_and_grads(p, ACTS, X[idx].T, y[idx])[2],
                                 opt.clip_norm)
        norms.append(norm)
        return g

    want = reference_run(params, grads_of, plan, 2 * plan.steps_per_epoch, opt)
    assert min(norms) > opt.clip_norm  # the clip did act
    assert max_err(m.get_weights(), want) <= 1e-10
    row = next(r for r in h.comm.rows if (r.layer, r.phase) == ("clip", "grad_norm"))
    p = m.grid.size
    assert row.measured_bytes == row.predicted_bytes == p * (p - 1) * 8
    assert grad_norm_phase(p, Machine(1e-4, 1e9, 8)).total_bytes == p * (p - 1) * 8
    m.close()


@pytest.mark.fast
def test_planner_prices_the_clipping_all_reduce():
    from dask_ipar.cost import PAPER_MACHINE, price_assignment
    from dask_ipar.cost.layers import FC

    layers = [FC(64, 32, name="dense0"), FC(32, 10, name="dense1")]
    plain = price_assignment(layers, {}, 2, 4, 64, PAPER_MACHINE)
    clipped = price_assignment(layers, {}, 2, 4, 64, PAPER_MACHINE, grad_clip=True)
    extra = [p for p in clipped.phases if p.phase == "grad_norm"]
    assert len(extra) == 1 and extra[0].total_bytes == 8 * 7 * PAPER_MACHINE.word_bytes
    assert len(clipped.phases) == len(plain.phases) + 1
    assert clipped.total_s > plain.total_s


_ADAMW = AdamW(0.02, weight_decay=0.1, schedule=CosineLR(9))
_NESTEROV = SGD(0.05, 0.9, nesterov=True, clip_norm=0.5)


# each optimizer on 3x2 (uneven both ways), and on one of the 1-D uneven grids
@pytest.mark.parametrize("grid,opt", [("3x2", _ADAMW), ("3x2", _NESTEROV),
                                      ("4x1", _ADAMW), ("1x4", _NESTEROV)],
                         ids=["3x2-adamw-cosine", "3x2-nesterov-clipped", "4x1-adamw-cosine",
                              "1x4-nesterov-clipped"])
def test_resume_on_uneven_grids_is_bit_equal(client, data, tmp_path, grid, opt):
    """Blocks that do not divide the widths (9 rows, 7 + 1 columns): stopped at step 5 with a
    checkpoint, resumed on the same grid, the run ends bit-equal to an uninterrupted one."""
    from dask_ipar.runtime.loop import Callback, Interrupted

    class StopAt5(Callback):
        def on_step_end(self, loop, stats):
            if stats.step == 5:
                loop.request_stop("test")

    X, y = data
    plain = mlp().distribute(client, grid)
    plain.fit(X, y, epochs=3, batch_size=12, optimizer=opt, seed=4)
    want = plain.get_weights()
    plain.close()
    first = mlp().distribute(client, grid)
    with pytest.raises(Interrupted):
        first.fit(X, y, epochs=3, batch_size=12, optimizer=opt, seed=4, max_inflight=0,
                  checkpoint=ck.Checkpointing(tmp_path, every=2), callbacks=[StopAt5()])
    first.close()
    again = mlp(seed=9).distribute(client, grid)
    again.fit(X, y, epochs=3, batch_size=12, optimizer=opt, seed=4,
              checkpoint=ck.Checkpointing(tmp_path, every=2))
    assert max_err(again.get_weights(), want) == 0.0
    again.close()


@pytest.mark.parametrize("opt", [OPTIMIZERS[0], OPTIMIZERS[2]], ids=["adam", "nesterov"])
def test_own_rows_first_with_adam_and_nesterov(client, data, monkeypatch, opt):
    """The forward's own-rows product and the own dX piece as tasks of their own (forced
    on this small MLP), with Adam's in-place update after the own piece and Nesterov's
    new blocks: the reference's weights after two epochs on 3x1."""
    from dask_ipar.nn import dense, dense_layout

    monkeypatch.setattr(dense_layout, "OWN_FIRST_MACS", 0)
    made = []
    for name in ("own_first", "own_dx_first"):
        real = getattr(dense, name)
        monkeypatch.setattr(dense, name, lambda *a, real=real, name=name: made.append(
            (name, real(*a))) or made[-1][1])
    _two_epochs_equal_the_reference(client, data, opt, "3x1")
    assert {n for n, split in made if split} == {"own_first", "own_dx_first"}
