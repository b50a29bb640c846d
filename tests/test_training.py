"""The one training loop (issue 18): the same batches, rates and results whatever the run
does around it (checkpoints, interrupts, resumes), its callbacks, scaling and the model
file. References: NumPy (:mod:`dask_ipar.reference`) and the formulas of the schedules."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dask_ipar import SGD, Adam, Dense, IparError, Sequential
from dask_ipar import reference as ref
from dask_ipar.io import checkpoint as ck
from dask_ipar.io.scaling import Standardizer
from dask_ipar.optim import CosineLR, StepLR, WarmupLR, parse_schedule
from dask_ipar.runtime.callbacks import EarlyStopping
from dask_ipar.runtime.loop import BatchPlan, Callback, Diverged, Interrupted

ACTS = ("tanh", "linear")


def make_model(seed=3, **kw):
    return Sequential([Dense(9, "tanh"), Dense(5)], input_dim=7, dtype="float64", seed=seed,
                      **kw)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(7)
    X = rng.standard_normal((50, 7))
    y = (X[:, :5].argmax(axis=1) + (X[:, 5] > 1.5)) % 5  # learnable, not trivially
    return X, y


def same(a, b):
    return all(np.array_equal(Wa, Wb) and np.array_equal(ba, bb)
               for (Wa, ba), (Wb, bb) in zip(a, b))


# ------------------------------------------------------------------ pure parts
@pytest.mark.fast
def test_batch_plan_is_a_pure_function_of_the_step():
    plan = BatchPlan(50, 12, seed=1)
    assert plan.steps_per_epoch == 4  # 50 // 12; the 2 left over join the last batch
    again = BatchPlan(50, 12, seed=1)
    epoch0 = [plan.indices(s) for s in range(4)]
    assert [len(b) for b in epoch0] == [12, 12, 12, 14]
    assert sorted(np.concatenate(epoch0)) == list(range(50))  # every sample once
    for s in range(12):
        np.testing.assert_array_equal(plan.indices(s), again.indices(s))
    assert not np.array_equal(plan.indices(0), plan.indices(4))  # epoch 1: a new order
    np.testing.assert_array_equal(BatchPlan(50, 12, shuffle=False).indices(1), np.arange(12, 24))
    # the checkpoint module's function is the same plan
    np.testing.assert_array_equal(ck.batch_indices(50, 12, 7, 1), plan.indices(7))
    with pytest.raises(IparError, match="exceeds the 5 samples"):
        BatchPlan(5, 8)


@pytest.mark.fast
def test_schedules_follow_their_formulas():
    lr = 0.1
    sgd = SGD(lr, schedule=StepLR(3, 0.5))
    assert [sgd.lr_at(s) for s in range(7)] == [lr * 0.5 ** (s // 3) for s in range(7)]
    cos = SGD(lr, schedule=CosineLR(10, 0.1))
    for s in (0, 3, 10, 15):
        t = min(s, 10) / 10
        assert cos.lr_at(s) == pytest.approx(lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))))
    warm = SGD(lr, schedule=WarmupLR(4, CosineLR(6)))
    assert [warm.lr_at(s) for s in range(4)] == pytest.approx([lr * (s + 1) / 4 for s in range(4)])
    assert warm.lr_at(4) == pytest.approx(lr) and warm.lr_at(10) == pytest.approx(0.0)
    assert warm.at_step(2).lr == pytest.approx(0.075) and warm.at_step(2).schedule is None
    assert parse_schedule("warmup:4+cosine", 10) == WarmupLR(4, CosineLR(6))
    assert parse_schedule("step:5:0.2", 10) == StepLR(5, 0.2)
    assert parse_schedule("none", 10) is None
    for bad in ("cosine:x", "step", "warmup:0", "linear"):
        with pytest.raises(IparError, match="warmup|schedule"):
            parse_schedule(bad, 10)


@pytest.mark.fast
def test_standardizer_per_feature_and_per_channel():
    rng = np.random.default_rng(0)
    X = rng.normal(5.0, 3.0, (40, 4))
    X[:, 2] = 7.0  # a constant feature becomes 0, not NaN
    s = Standardizer.fit(X)
    Z = s.apply(X)
    np.testing.assert_allclose(Z[:, [0, 1, 3]].mean(axis=0), 0, atol=1e-12)
    np.testing.assert_allclose(Z[:, [0, 1, 3]].std(axis=0), 1, atol=1e-12)
    assert (Z[:, 2] == 0).all()
    imgs = rng.normal(2.0, 4.0, (6, 3, 5, 5))
    si = Standardizer.fit(imgs)
    assert si.mean.shape == (3,)
    np.testing.assert_allclose(si.apply(imgs).mean(axis=(0, 2, 3)), 0, atol=1e-12)
    with pytest.raises(IparError, match="standardizes 4 features"):
        s.apply(X[:, :3])


@pytest.mark.fast
def test_model_file_errors(tmp_path):
    with pytest.raises(IparError, match="does not exist"):
        Sequential.load(tmp_path / "none.npz")
    np.savez(tmp_path / "other.npz", X=np.zeros(3))
    with pytest.raises(IparError, match="not a dask-ipar model file"):
        Sequential.load(tmp_path / "other.npz")
    (tmp_path / "text.npz").write_text("hello")
    with pytest.raises(IparError, match="not a dask-ipar model file"):
        Sequential.load(tmp_path / "text.npz")


# ----------------------------------------------------------------- on a cluster
def test_same_seed_same_weights_with_and_without_checkpoints(client, data, tmp_path):
    """fit, fit with checkpoints every 1 or 3 steps, and train_with_checkpoints: the same
    batches (the 2 samples left over in the last of each epoch), so bit-equal weights and
    losses."""
    X, y = data
    opt = SGD(0.1, 0.9, 1e-3)
    plain = make_model().distribute(client, "2x2")
    h = plain.fit(X, y, epochs=3, batch_size=12, optimizer=opt, seed=5)
    expected, losses = plain.get_weights(), [s.loss for s in h.steps]
    assert len(h.steps) == 12 and h.steps[3].batch == 14  # 4 steps per epoch
    plain.close()
    for every in (1, 3):
        m = make_model().distribute(client, "2x2")
        hc = m.fit(X, y, epochs=3, batch_size=12, optimizer=opt, seed=5,
                   checkpoint=ck.Checkpointing(tmp_path / f"e{every}", every=every))
        assert same(m.get_weights(), expected), every
        assert [s.loss for s in hc.steps] == losses
        m.close()
    m = make_model().distribute(client, "2x2")
    r = ck.train_with_checkpoints(m, X, y, steps=12, every=4, batch_size=12, optimizer=opt,
                                  seed=5, directory=tmp_path / "twc")
    assert same(m.get_weights(), expected) and r["losses"] == losses
    m.close()


class _StopAt(Callback):
    def __init__(self, step):
        self.at = step

    def on_step_end(self, loop, stats):
        if stats.step == self.at:
            loop.request_stop("test", None)


def test_interrupt_checkpoints_and_resume_equals_uninterrupted(client, data, tmp_path):
    """A stop requested at step 7 (mid-epoch) writes ckpt-7; resuming with a schedule runs
    the same rates and batches: the weights equal an uninterrupted run's bit for bit."""
    X, y = data
    opt = SGD(0.1, 0.9, 1e-3, schedule=WarmupLR(3, CosineLR(12)))
    plain = make_model().distribute(client, "2x2")
    plain.fit(X, y, epochs=3, batch_size=12, optimizer=opt, seed=5)
    expected = plain.get_weights()
    plain.close()
    m = make_model().distribute(client, "2x2")
    with pytest.raises(Interrupted) as err:
        m.fit(X, y, epochs=3, batch_size=12, optimizer=opt, seed=5, max_inflight=0,
              checkpoint=ck.Checkpointing(tmp_path, every=5), callbacks=[_StopAt(7)])
    assert err.value.step == 7 and err.value.saved
    assert ck.latest(tmp_path).endswith("ckpt-7")
    m.close()
    again = make_model(seed=99).distribute(client, "2x2")  # its own init is overwritten
    h = again.fit(X, y, epochs=3, batch_size=12, optimizer=opt, seed=5,
                  checkpoint=ck.Checkpointing(tmp_path, every=5))
    assert [s.step for s in h.steps] == list(range(8, 13))
    assert same(again.get_weights(), expected)
    again.close()


def test_schedule_matches_numpy_reference(client, data):
    X, y = data
    opt = SGD(0.2, 0.5, 1e-3, schedule=StepLR(2, 0.5))
    m = make_model().distribute(client, "1x2")
    params = m.get_weights()
    m.fit(X, y, epochs=2, batch_size=16, optimizer=opt, seed=2)
    plan = BatchPlan(50, 16, 2)
    p, v = params, [None] * len(params)
    for s in range(2 * plan.steps_per_epoch):
        idx = plan.indices(s)
        _, _, grads = ref.mlp_loss_and_grads(p, ACTS, X[idx].T, y[idx])
        p, v = ref.sgd_step(p, v, grads, opt.lr_at(s), opt.momentum, opt.weight_decay)
    for (Wa, ba), (Wb, bb) in zip(m.get_weights(), p):
        np.testing.assert_allclose(Wa, Wb, rtol=0, atol=1e-10)
        np.testing.assert_allclose(ba, bb, rtol=0, atol=1e-10)
    m.close()


def test_validation_early_stopping_restores_the_best_epoch(client, data, tmp_path):
    """Validation labels that are noise: the validation loss rises as the model fits the
    training set, early stopping ends the run and puts back the best epoch's weights."""
    X, y = data
    rng = np.random.default_rng(1)
    Xv, yv = rng.standard_normal((20, 7)), rng.integers(0, 5, 20)
    seen = {}

    class Keep(Callback):
        def on_epoch_end(self, loop, record):
            seen[record["epoch"]] = loop.model.get_weights()

    m = make_model().distribute(client, "2x1")
    stop = EarlyStopping(patience=2)
    log = tmp_path / "m.jsonl"
    h = m.fit(X, y, epochs=40, batch_size=10, optimizer=SGD(0.2), validation_data=(Xv, yv),
              callbacks=[Keep(), stop], log_file=log)
    assert h.stopped and "restored the weights of epoch" in h.stopped
    assert len(h.epochs) < 40 and len(h.epochs) == stop.best_epoch + 2
    vals = [e["val_loss"] for e in h.epochs]
    assert vals[stop.best_epoch - 1] == min(vals)
    assert same(m.get_weights(), seen[stop.best_epoch])
    r = m.evaluate(Xv, yv)
    assert r["loss"] == pytest.approx(min(vals), rel=1e-12)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [e["epoch"] for e in h.epochs]
    assert rows[0]["val_loss"] == vals[0]
    m.close()


def test_standardize_is_stored_applied_and_saved(client, data, tmp_path):
    X, y = data
    Xs = X * [1, 10, 100, 1000, 1, 1, 0.01] + 50
    m = make_model().distribute(client, "1x2")
    m.fit(Xs, y, epochs=2, batch_size=10, standardize=True)
    assert m.scaling is not None
    sc = Standardizer.fit(Xs)
    np.testing.assert_array_equal(m.scaling.mean, sc.mean)
    logits = m.forward(Xs)
    saved = m.scaling
    m.scaling = None  # the same network on inputs scaled by hand
    np.testing.assert_allclose(m.forward(sc.apply(Xs)), logits, rtol=0, atol=1e-12)
    m.scaling = saved
    path = m.save(tmp_path / "model.npz")
    with np.load(path, allow_pickle=False) as z:  # no pickle inside
        assert json.loads(str(z["meta"]))["layers"][0] == {"type": "Dense", "units": 9,
                                                          "activation": "tanh", "bias": True}
    back = Sequential.load(path).distribute(client, "2x1")  # another grid
    assert same(back.get_weights(), m.get_weights())
    np.testing.assert_allclose(back.forward(Xs), logits, rtol=0, atol=1e-12)
    assert back.evaluate(Xs, y)["accuracy"] == m.evaluate(Xs, y)["accuracy"]
    back.close()
    m.close()


def test_cnn_model_file_round_trip(client, tmp_path):
    from dask_ipar import Conv2d, Flatten, MaxPool2d

    cnn = Sequential([Conv2d(3, (3, 3), activation="relu", padding=1), MaxPool2d(2),
                      Flatten(), Dense(4)], input_shape=(1, 6, 6), dtype="float64", seed=1)
    cnn.distribute(client, "2x1")
    X = np.random.default_rng(0).standard_normal((5, 1, 6, 6))
    path = cnn.save(tmp_path / "cnn.npz")
    back = Sequential.load(path).distribute(client, "1x1")
    assert back.layers == cnn.layers
    np.testing.assert_allclose(back.forward(X), cnn.forward(X), rtol=0, atol=1e-12)
    back.close()
    cnn.close()


def test_divergence_stops_with_the_rate_and_scaling_named(client, data):
    X, y = data
    m = make_model().distribute(client, "1x2")
    with pytest.raises(Diverged, match=r"diverged at step \d+: .*learning rate 50"):
        m.fit(X, y, epochs=5, batch_size=10, optimizer=SGD(50.0))
    m.close()
    # pixels-like inputs (0..300) into ReLUs: a first loss far above chance, then no learning
    m = Sequential([Dense(16, "relu"), Dense(5)], input_dim=7, dtype="float64", seed=3)
    m.distribute(client, "1x2")
    with pytest.raises(Diverged, match="standardize"):
        m.fit(np.abs(X) * 100, y, epochs=3, batch_size=5, optimizer=SGD(0.05))
    m.close()


def test_validation_needs_a_pair(client, data):
    X, y = data
    m = make_model().distribute(client, "1x1")
    with pytest.raises(IparError, match="validation_data must be a pair"):
        m.fit(X, y, validation_data=X)
    m.close()


def test_rewind_after_a_fault_keeps_history_log_and_early_stopping_exact(client, data,
                                                                         tmp_path):
    """A step fails once in epoch 3; a callback reloads the checkpoint of step 4 (epoch 1's
    end) and the loop goes back there: epochs 2 and 3 run again. The history and the
    metrics log hold each epoch once, early stopping counts each once, and the weights
    equal an uninterrupted run's."""
    X, y = data
    rng = np.random.default_rng(1)
    val = (rng.standard_normal((20, 7)), rng.integers(0, 5, 20))
    opt = SGD(0.2, 0.9)

    def run(extra, log):
        m = make_model().distribute(client, "2x1")
        stop = EarlyStopping(patience=3, restore_best=False)
        h = m.fit(X, y, epochs=6, batch_size=12, optimizer=opt, seed=2, validation_data=val,
                  callbacks=[stop, *extra], log_file=log,
                  checkpoint=ck.Checkpointing(tmp_path / log.stem, every=4, keep=None))
        return m, h, stop

    class Boom(RuntimeError):
        pass

    class FailOnce(Callback):
        failed = False

        def on_step_end(self, loop, stats):
            if stats.step == 10 and not self.failed:
                self.failed = True
                raise Boom("step 10 fails once")

        def on_error(self, loop, exc):
            if isinstance(exc, Boom):
                return ck.load(loop.model, tmp_path / "faulty" / "ckpt-4")["step"]
            return None

    ref_model, ref, ref_stop = run([], tmp_path / "plain.jsonl")
    model, h, stop = run([FailOnce()], tmp_path / "faulty.jsonl")
    assert [e["epoch"] for e in h.epochs] == [e["epoch"] for e in ref.epochs]
    assert [e["val_loss"] for e in h.epochs] == [e["val_loss"] for e in ref.epochs]
    assert (stop.best_epoch, stop.wait) == (ref_stop.best_epoch, ref_stop.wait)
    assert h.stopped == ref.stopped
    rows = [json.loads(line) for line in (tmp_path / "faulty.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [e["epoch"] for e in ref.epochs]
    assert same(model.get_weights(), ref_model.get_weights())
    model.close()
    ref_model.close()


def test_resume_on_other_data_or_batches_is_refused(client, data, tmp_path):
    X, y = data
    m = make_model().distribute(client, "1x2")
    m.fit(X, y, epochs=1, batch_size=12, checkpoint=ck.Checkpointing(tmp_path))
    m.close()
    again = make_model().distribute(client, "1x2")
    with pytest.raises(IparError, match=r"training samples 40 \(the checkpoint's run: 50\)"):
        again.fit(X[:40], y[:40], epochs=2, batch_size=12,
                  checkpoint=ck.Checkpointing(tmp_path))
    with pytest.raises(IparError, match=r"batch size 10 \(the checkpoint's run: 12\)"):
        again.fit(X, y, epochs=2, batch_size=10, checkpoint=ck.Checkpointing(tmp_path))
    with pytest.raises(IparError, match="holds SGD momentum, which Adam cannot continue"):
        again.fit(X, y, epochs=2, batch_size=12, optimizer=Adam(0.01),
                  checkpoint=ck.Checkpointing(tmp_path))
    h = again.fit(X, y, epochs=2, batch_size=12, optimizer=Adam(0.01),
                  checkpoint=ck.Checkpointing(tmp_path, allow_changes=True))
    assert [s.step for s in h.steps] == [5, 6, 7, 8] and again._store.opt[0] == "adam"
    again.close()
