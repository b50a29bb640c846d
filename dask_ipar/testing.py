"""Checks of the engine against the single-process NumPy reference, for tests and users.

``check_mlp(client, grid, ...)`` runs the forward pass, the loss, every
gradient and a run of SGD steps on ``grid`` and compares them with
:mod:`dask_ipar.reference`; it also runs a directional finite-difference
check of the distributed gradient, and checks that the bytes the SGD steps
moved between workers equal the cost model's prediction per layer and phase.
It raises ``AssertionError`` with the
offending layer on a mismatch and returns the measured errors.
"""

from __future__ import annotations

import numpy as np

from dask_ipar.layers import Dense
from dask_ipar.model import Sequential
from dask_ipar.optim import SGD
from dask_ipar.reference import mlp_forward, mlp_loss_and_grads, sgd_step

__all__ = ["awkward_problem", "check_mlp", "rel_err"]


def rel_err(a, b) -> float:
    """``max|a - b| / max|b|`` (absolute when ``b`` is all zero)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    scale = np.abs(b).max()
    return float(np.abs(a - b).max() / (scale if scale > 0 else 1.0))


def awkward_problem(sizes=(37, 29, 13, 10), batch=23, seed=0):
    """Random float64 data with sizes that divide nothing: ``X (batch x d0)``, labels."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((batch, sizes[0]))
    y = rng.integers(0, sizes[-1], batch)
    return X, y


def _layers(sizes, activations):
    return [Dense(w, a) for w, a in zip(sizes[1:], activations)]


def check_mlp(client, grid, sizes=(37, 29, 13, 10), activations=("relu", "tanh", "linear"),
              batch=23, steps=20, optimizer=SGD(lr=0.1, momentum=0.9, weight_decay=0.01),
              rtol=1e-12, sgd_tol=1e-10, fd_eps=1e-6, fd_rtol=1e-6, bytes_rtol=0.02,
              seed=0) -> dict:
    """Compare a float64 MLP on ``grid`` with the NumPy reference; returns the errors."""
    X, y = awkward_problem(sizes, batch, seed)
    model = Sequential(_layers(sizes, activations), input_dim=sizes[0], dtype="float64",
                       seed=seed)
    model.distribute(client, grid)
    try:
        params = model.get_weights()
        acts = [lay.activation for lay in model.layers]
        errors = {}
        # forward
        ref_logits = mlp_forward(params, acts, X.T)[0].T
        errors["logits"] = rel_err(model.forward(X), ref_logits)
        # loss and gradients
        loss, acc, grads = model.gradients(X, y)
        ref_loss, ref_acc, ref_grads = mlp_loss_and_grads(params, acts, X.T, y)
        errors["loss"] = abs(loss - ref_loss) / abs(ref_loss)
        errors["accuracy"] = abs(acc - ref_acc)
        for k, ((gw, gb), (rw, rb)) in enumerate(zip(grads, ref_grads)):
            errors[f"dW{k}"] = rel_err(gw, rw)
            errors[f"db{k}"] = rel_err(gb, rb)
        for name, err in errors.items():
            assert err <= rtol, f"grid {grid}: {name} differs from the reference by {err:.3e}"
        # directional finite difference of the distributed loss
        rng = np.random.default_rng(seed + 1)
        direction = [(rng.standard_normal(W.shape), rng.standard_normal(b.shape))
                     for W, b in params]
        slope = sum(float((gw * dw).sum() + (gb * db).sum())
                    for (gw, gb), (dw, db) in zip(grads, direction))
        losses = []
        for sign in (1, -1):
            model.set_weights([(W + sign * fd_eps * dw, b + sign * fd_eps * db)
                               for (W, b), (dw, db) in zip(params, direction)])
            losses.append(model.evaluate(X, y)["loss"])
        fd = (losses[0] - losses[1]) / (2 * fd_eps)
        errors["finite_difference"] = abs(fd - slope) / max(abs(slope), 1e-12)
        assert errors["finite_difference"] <= fd_rtol, (
            f"grid {grid}: finite difference {fd} vs gradient {slope}"
        )
        # SGD steps against the reference optimizer
        model.set_weights(params)
        history = model.fit(X, y, epochs=steps, batch_size=batch, optimizer=optimizer,
                            shuffle=False)
        errors["comm"] = history.comm
        p, v = params, [None] * len(params)
        for _ in range(steps):
            _, _, g = mlp_loss_and_grads(p, acts, X.T, y)
            p, v = sgd_step(p, v, g, optimizer.lr, optimizer.momentum, optimizer.weight_decay)
        trained = model.get_weights()
        errors["sgd"] = max(max(rel_err(a[0], b[0]), rel_err(a[1], b[1]))
                            for a, b in zip(trained, p))
        assert errors["sgd"] <= sgd_tol, (
            f"grid {grid}: weights after {steps} SGD steps differ by {errors['sgd']:.3e}"
        )
        for row in history.comm.rows:
            errors[f"bytes {row.layer} {row.phase}"] = abs(row.ratio - 1)
            assert abs(row.ratio - 1) <= bytes_rtol, (
                f"grid {grid}: {row.layer} {row.phase} moved {row.measured_bytes:.0f} bytes per "
                f"step, the cost model predicts {row.predicted_bytes:.0f}"
            )
        return errors
    finally:
        model.close()
