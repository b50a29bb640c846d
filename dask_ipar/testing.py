"""Checks of the engine against the single-process NumPy reference, for tests and users.

``compare_mlp(client, grid, ...)`` runs the forward pass, the loss, every
gradient and a run of SGD steps on ``grid`` and compares them with
:mod:`dask_ipar.reference`; it also runs a directional finite-difference
check of the distributed gradient, and checks that the bytes the SGD steps
moved between workers equal the cost model's prediction per layer and phase.
It returns the measured errors;
``check_mlp`` asserts them (``AssertionError`` naming the grid and layer).
"""

from __future__ import annotations

import numpy as np

from dask._task_spec import TaskRef

from dask_ipar.layout.grid import GridBinding, parse_grid
from dask_ipar.nn.layers import Dense
from dask_ipar.model import Sequential
from dask_ipar.optim import SGD
from dask_ipar.reference import cnn_loss_and_grads, mlp_forward, mlp_loss_and_grads, sgd_step

__all__ = ["awkward_problem", "compare_mlp", "check_mlp", "compare_cnn", "check_cnn",
           "awkward_cnn", "rel_err", "fake_binding", "step_graph"]


def rel_err(a, b) -> float:
    """``max|a - b| / max|b|`` (absolute when ``b`` is all zero)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    scale = np.abs(b).max()
    return float(np.abs(a - b).max() / (scale if scale > 0 else 1.0))


def fake_binding(grid) -> GridBinding:
    """``grid`` bound to addresses no worker listens on: for building graphs only."""
    grid = parse_grid(grid)
    return GridBinding(grid, tuple(f"tcp://10.255.{k // 250}.{k % 250 + 1}:1"
                                   for k in range(grid.size)))


def step_graph(model, grid, batch: int):
    """``(engine, graph)`` of one training step of ``model`` on ``grid`` for ``batch``
    samples, built on :func:`fake_binding` (no cluster): the fast tier of the tests.

    The graph's inputs (``("x", i, j)``, ``("y", i, j)``) and weights (``("w<k>", i, j)``)
    are keys it does not compute; ``graph.routed_words()`` is what its collectives move.
    """
    engine = model._make_engine(fake_binding(grid))
    cells = engine.grid.cells()
    x = {c: TaskRef(("x", *c)) for c in cells}
    y = {c: TaskRef(("y", *c)) for c in cells}
    n = len(engine.param_layouts)
    g, *_ = engine.train_step(x, y, batch, [f"w{k}" for k in range(n)], [None] * n, 0,
                              0.1, 0.9, 0.0)
    return engine, g


def awkward_problem(sizes=(37, 29, 13, 10), batch=23, seed=0):
    """Random float64 data with sizes that divide nothing: ``X (batch x d0)``, labels."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((batch, sizes[0]))
    y = rng.integers(0, sizes[-1], batch)
    return X, y


def _layers(sizes, activations):
    return [Dense(w, a) for w, a in zip(sizes[1:], activations)]


def compare_mlp(client, grid, sizes=(37, 29, 13, 10), activations=("relu", "tanh", "linear"),
                batch=23, steps=20, optimizer=SGD(lr=0.1, momentum=0.9, weight_decay=0.01),
                fd_eps=1e-6, seed=0, device="cpu", executor=None) -> dict:
    """Run a float64 MLP on ``grid`` beside the NumPy reference; return every error.

    ``executor``: how the SGD steps run (:attr:`Sequential.executor`; None: the default).

    Keys: ``logits``, ``loss``, ``accuracy``, ``dW<k>``/``db<k>`` (relative errors),
    ``finite_difference`` (directional derivative vs gradient), ``sgd<k>`` (relative
    error of layer k's weights after ``steps`` SGD steps), ``comm`` (the
    :class:`~dask_ipar.runtime.meter.CommReport` of those steps).
    """
    X, y = awkward_problem(sizes, batch, seed)
    model = Sequential(_layers(sizes, activations), input_dim=sizes[0], dtype="float64",
                       seed=seed, device=device)
    model.distribute(client, grid)
    model.executor = executor or model.executor
    try:
        params = model.get_weights()
        acts = [lay.activation for lay in model.layers]
        errors = {}
        ref_logits = mlp_forward(params, acts, X.T)[0].T
        errors["logits"] = rel_err(model.forward(X), ref_logits)
        loss, acc, grads = model.gradients(X, y)
        ref_loss, ref_acc, ref_grads = mlp_loss_and_grads(params, acts, X.T, y)
        _gradient_errors(errors, (loss, acc, grads), (ref_loss, ref_acc, ref_grads))
        errors["finite_difference"] = _finite_difference(
            model, params, grads, X, y, np.random.default_rng(seed + 1), fd_eps)
        _sgd_errors(errors, model, X, y, params, steps, batch, optimizer,
                    lambda p: mlp_loss_and_grads(p, acts, X.T, y)[2])
        return errors
    finally:
        model.close()


def _gradient_errors(errors, got, ref):
    """Loss, accuracy and every ``dW<k>``/``db<k>`` error of ``got`` against ``ref``."""
    (loss, acc, grads), (ref_loss, ref_acc, ref_grads) = got, ref
    errors["loss"] = abs(loss - ref_loss) / abs(ref_loss)
    errors["accuracy"] = abs(acc - ref_acc)
    for k, ((gw, gb), (rw, rb)) in enumerate(zip(grads, ref_grads)):
        errors[f"dW{k}"] = rel_err(gw, rw)
        if rb is not None:
            errors[f"db{k}"] = rel_err(gb, rb)


def _finite_difference(model, params, grads, X, y, rng, eps) -> float:
    """Directional derivative of the distributed loss vs the distributed gradient."""
    def rand(a):
        return None if a is None else rng.standard_normal(a.shape)

    def dot(a, b):
        return 0.0 if a is None else float((a * b).sum())

    direction = [(rand(W), rand(b)) for W, b in params]
    slope = sum(dot(gw, dw) + dot(gb, db) for (gw, gb), (dw, db) in zip(grads, direction))
    losses = []
    for sign in (1, -1):
        model.set_weights([(W + sign * eps * dw, None if b is None else b + sign * eps * db)
                           for (W, b), (dw, db) in zip(params, direction)])
        losses.append(model.evaluate(X, y)["loss"])
    fd = (losses[0] - losses[1]) / (2 * eps)
    return abs(fd - slope) / max(abs(slope), 1e-12)


def _sgd_errors(errors, model, X, y, params, steps, batch, optimizer, ref_grads_of):
    """``steps`` full-batch SGD steps on the grid beside :func:`sgd_step` on the reference.

    Sets ``sgd<k>`` (each layer's weight error afterwards) and ``comm`` (the steps' bytes).
    """
    # fresh weight keys: replicas fetched by earlier calls would otherwise spare the
    # first step's weight all-gather some transfers
    model.set_weights(params)
    history = model.fit(X, y, epochs=steps, batch_size=batch, optimizer=optimizer,
                        shuffle=False)
    p, v = params, [None] * len(params)
    for _ in range(steps):
        p, v = sgd_step(p, v, ref_grads_of(p), optimizer.lr, optimizer.momentum,
                        optimizer.weight_decay)
    for k, (a, b) in enumerate(zip(model.get_weights(), p)):
        errors[f"sgd{k}"] = max(rel_err(a[0], b[0]), 0.0 if b[1] is None else rel_err(a[1], b[1]))
    errors["comm"] = history.comm


def check_mlp(client, grid, *, rtol=1e-12, sgd_tol=1e-10, fd_rtol=1e-6, bytes_rtol=0.02,
              **kwargs) -> dict:
    """:func:`compare_mlp`, asserting every error is within tolerance; returns the errors."""
    errors = compare_mlp(client, grid, **kwargs)
    _assert_errors(errors, grid, rtol, sgd_tol, fd_rtol, bytes_rtol)
    return errors


def awkward_cnn():
    """A float64 CNN whose sizes divide nothing, and its input shape.

    Conv 3x3 'same' (ReLU), 2x2 max pooling (odd height: a window straddles strips), a
    5x3 conv with stride 2 and asymmetric padding (tanh), 2x2 average pooling with
    stride 1 and padding, then dense layers: output heights 35, 17, 9, 10, so every
    grid with Pr <= 8 applies.
    """
    from dask_ipar.nn.layers import AvgPool2d, Conv2d, Flatten, MaxPool2d

    layers = [Conv2d(4, 3, activation="relu"), MaxPool2d(2),
              Conv2d(6, (5, 3), stride=2, padding=(2, 1, 1, 1), activation="tanh"),
              AvgPool2d(2, stride=1, padding=1), Flatten(), Dense(11, "relu"), Dense(8)]
    return layers, (2, 35, 9)


def compare_cnn(client, grid, layers=None, input_shape=None, batch=9, steps=2,
                optimizer=SGD(lr=0.05, momentum=0.9, weight_decay=0.01), fd_eps=None,
                seed=0, device="cpu", executor=None) -> dict:
    """Run a float64 CNN on ``grid`` beside the NumPy reference; return every error.

    Keys: ``logits``, ``loss``, ``accuracy``, ``dW<k>``/``db<k>`` (every layer with
    weights, conv layers first), ``sgd<k>`` after ``steps`` SGD steps,
    ``finite_difference`` when ``fd_eps`` is given, ``comm`` (bytes of the SGD steps).
    """
    if layers is None:
        layers, input_shape = awkward_cnn()
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((batch, *input_shape))
    n_classes = layers[-1].units
    y = rng.integers(0, n_classes, batch)
    model = Sequential(layers, input_shape=input_shape, dtype="float64", seed=seed,
                       device=device)
    model.distribute(client, grid)
    model.executor = executor or model.executor
    try:
        params = model.get_weights()
        errors = {}
        loss, acc, grads = model.gradients(X, y)
        ref_loss, ref_acc, ref_logits, ref_grads = cnn_loss_and_grads(layers, params, X, y)
        errors["logits"] = rel_err(model.forward(X), ref_logits)
        _gradient_errors(errors, (loss, acc, grads), (ref_loss, ref_acc, ref_grads))
        if fd_eps:
            errors["finite_difference"] = _finite_difference(model, params, grads, X, y, rng,
                                                             fd_eps)
        _sgd_errors(errors, model, X, y, params, steps, batch, optimizer,
                    lambda p: cnn_loss_and_grads(layers, p, X, y)[3])
        return errors
    finally:
        model.close()


def check_cnn(client, grid, *, rtol=1e-12, sgd_tol=1e-10, fd_rtol=1e-6, bytes_rtol=0.02,
              **kwargs) -> dict:
    """:func:`compare_cnn`, asserting every error is within tolerance; returns the errors."""
    errors = compare_cnn(client, grid, **kwargs)
    _assert_errors(errors, grid, rtol, sgd_tol, fd_rtol, bytes_rtol)
    return errors


def _assert_errors(errors, grid, rtol, sgd_tol, fd_rtol, bytes_rtol):
    for name, err in errors.items():
        if name in ("logits", "loss", "accuracy") or name[:2] in ("dW", "db"):
            assert err <= rtol, f"grid {grid}: {name} differs from the reference by {err:.3e}"
        elif name.startswith("sgd"):
            assert err <= sgd_tol, (
                f"grid {grid}: layer {name[3:]} weights after the SGD steps differ by {err:.3e}"
            )
    if "finite_difference" in errors:
        assert errors["finite_difference"] <= fd_rtol, (
            f"grid {grid}: finite difference disagrees with the gradient by "
            f"{errors['finite_difference']:.3e}"
        )
    for row in errors["comm"].rows:
        assert abs(row.ratio - 1) <= bytes_rtol, (
            f"grid {grid}: {row.layer} {row.phase} moved {row.measured_bytes:.0f} bytes per "
            f"step, the cost model predicts {row.predicted_bytes:.0f}"
        )
