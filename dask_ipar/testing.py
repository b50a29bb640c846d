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

import numbers

import numpy as np

from dask._task_spec import TaskRef

from dask_ipar.layout.grid import GridBinding, parse_grid
from dask_ipar.nn.graph import StepGraph
from dask_ipar.nn.layers import Dense
from dask_ipar.model import Sequential
from dask_ipar.optim import SGD
from dask_ipar.reference import cnn_loss_and_grads, mlp_forward, mlp_loss_and_grads, sgd_step
from dask_ipar.errors import IparError
from dask_ipar.layout.grid import Grid
from dask_ipar.layout.partition import grid_shapes
from dask_ipar.nn.dense_layout import check_dense_grid
from dask_ipar.nn.layers import AvgPool2d, Conv2d, Flatten, MaxPool2d
from dask_ipar.runtime.placement import check_batch
from dask_ipar.runtime.workers import scheduler_workers

__all__ = ["awkward_problem", "compare_mlp", "check_mlp", "compare_cnn", "check_cnn",
           "awkward_cnn", "rel_err", "fake_binding", "step_graph", "check_layer",
           "wait_for_program_bars"]


def wait_for_program_bars(client, timeout_s: float = 10.0, start: float | None = None) -> None:
    """Wait (at most ``timeout_s``) until dask's task stream shows no worker program's own
    bar: each is replaced by its layers' bars once the program's records reach the
    scheduler, a moment after the program ends (:mod:`dask_ipar.dashboard.stream`).
    ``start`` (``time.time()``): only bars since then (an earlier run's program that
    failed keeps its bar: on a shared cluster that would hold every wait to ``timeout_s``)."""
    import time

    from dask.utils import key_split

    def program_bar(e):  # filtered here: the stream is not in stop order once spliced
        return key_split(e["key"]).startswith("step.run") and (
            start is None or max(ss["stop"] for ss in e["startstops"]) >= start)

    deadline = time.monotonic() + timeout_s
    while any(map(program_bar, client.get_task_stream())) and time.monotonic() < deadline:
        time.sleep(0.1)


def rel_err(a, b) -> float:
    """``max|a - b| / max|b|`` (absolute when ``b`` is all zero)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    scale = np.abs(b).max()
    return float(np.abs(a - b).max() / (scale if scale > 0 else 1.0))


def fake_binding(grid) -> GridBinding:
    """``grid`` bound to addresses no worker listens on: for building graphs only."""
    return GridBinding.placeholder(grid)


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
                              0.1, 0.9, 0.0, g=StepGraph(record_routes=True))
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
                fd_eps=1e-6, seed=0, device="cpu", executor=None, layers=None) -> dict:
    """Run a float64 MLP on ``grid`` beside the NumPy reference; return every error.

    ``executor``: how the SGD steps run (:attr:`Sequential.executor`; None: the default).
    ``layers``: Dense layers to run instead of ``sizes``/``activations`` (then ``sizes[0]``
    is the input width); ``fd_eps=None`` skips the finite-difference check.

    Keys: ``logits``, ``loss``, ``accuracy``, ``dW<k>``/``db<k>`` (relative errors),
    ``finite_difference`` (directional derivative vs gradient), ``sgd<k>`` (relative
    error of layer k's weights after ``steps`` SGD steps), ``comm`` (the
    :class:`~dask_ipar.runtime.meter.CommReport` of those steps).
    """
    layers = _layers(sizes, activations) if layers is None else list(layers)
    X, y = awkward_problem((sizes[0], layers[-1].units), batch, seed)
    model = Sequential(layers, input_dim=sizes[0], dtype="float64", seed=seed, device=device)
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
        if fd_eps:
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
                        shuffle=False, diverge_factor=0)  # arbitrary data: compared, not judged
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


# ------------------------------------------------------------- one user layer
def check_layer(client, layer, input_shape, *, grids=None, batch=9, dtype="float64",
                classes=None, input_gradient=True, steps=2, optimizer=None, fd_eps=1e-6,
                seed=0, rtol=1e-12, sgd_tol=1e-10, fd_rtol=1e-6, bytes_rtol=0.02,
                device="cpu", executor=None) -> dict:
    """Check one layer against the NumPy reference on every grid of the cluster it fits.

    The layer runs in the smallest network the engine takes: ``[layer, Dense(classes)]``
    for a :class:`~dask_ipar.nn.layers.Dense` layer (``input_shape``: its number of input
    features), ``[layer, Flatten(), Dense(classes)]`` for a ``Conv2d``, ``MaxPool2d`` or
    ``AvgPool2d`` (``input_shape``: ``(C, H, W)``). With ``input_gradient=True`` a
    shape-keeping layer with weights goes in front (``Dense(d)``, or a 1x1 ``Conv2d(C)``):
    the engine computes no input gradient for a network's first layer (no backward at all
    for a pooling layer there), so the layer's backward to its input would go unchecked;
    it shows in the front layer's weight gradient. A grid the engine takes only without
    the front layer is checked without it.

    On each grid run :func:`compare_mlp`'s / :func:`compare_cnn`'s float64 checks: logits,
    loss and every weight gradient ``dW<k>``/``db<k>`` (``rtol``), a directional finite
    difference (``fd_rtol``; ``fd_eps=None`` skips it), the weights after ``steps`` SGD
    steps (``sgd_tol``) and the bytes they moved against the cost model per layer and phase
    (``bytes_rtol``). The head is linear and its gradient ``dZ x^T`` holds the layer's
    output for every sample, so a forward error shows there where the logits may hide it.

    Parameters
    ----------
    client : distributed.Client
        Grids up to ``P`` = its number of workers are checked.
    layer : Dense, Conv2d, MaxPool2d or AvgPool2d
    input_shape : int for a Dense layer, ``(C, H, W)`` otherwise
    grids : list of str such as ``"2x2"`` (or Grid), optional
        Default: every ``Pr x Pc`` (:func:`~dask_ipar.layout.partition.grid_shapes`) of
        every ``P`` up to the workers.
    batch : int
        Samples of the random data.
    dtype : "float64"
        The only one: the reference and the tolerances are float64.
    classes : int, optional
        Outputs of the head (default ``max(4, largest Pr)``: the head fits every grid).
    steps, optimizer, seed, device, executor
        As in :func:`compare_cnn` (``optimizer`` default ``SGD(0.05, 0.9, 0.01)``).

    Returns
    -------
    dict
        ``{"2x2": errors, ...}`` in grid order: :func:`compare_cnn`'s errors plus
        ``"network"`` (the layers that ran) per grid checked; ``{"skipped": reason}`` per
        grid the engine refuses for the layer or that needs more workers than there are.

    Raises
    ------
    AssertionError
        Naming every grid and quantity out of tolerance.
    IparError
        For a bad argument, a layer that does not take ``input_shape``, or no grid fitting.

    Examples
    --------
    >>> from dask_ipar import Conv2d
    >>> layer = Conv2d(6, (5, 3), stride=2, padding=(2, 1, 1, 1), activation="tanh")
    >>> grids = ["1x1", "2x2", "8x1"]
    >>> report = check_layer(client, layer, (2, 11, 7), grids=grids)   # doctest: +SKIP
    >>> report["2x2"]["dW1"] <= 1e-12  # the layer's own weights       # doctest: +SKIP
    True
    >>> report["8x1"]["skipped"]                                       # doctest: +SKIP
    "layer 0 (Conv2d) has 5 output rows, fewer than the grid's Pr = 8 rows ..."
    """
    kind, shape = _layer_input(layer, input_shape)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt != np.float64:
        raise IparError(f"check_layer compares with the float64 NumPy reference at float64 "
                        f"tolerances: dtype must be 'float64', got {dtype!r} (the layer's "
                        "task graph is the same for float32).")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise IparError(f"batch must be a positive integer number of samples, got {batch!r}.")
    n_workers = len(scheduler_workers(client))
    wanted = (_parse_grids(grids) if grids is not None
              else [Grid(pr, pc) for p in range(1, n_workers + 1) for pr, pc in grid_shapes(p)])
    if classes is None:
        classes = max([4] + [g.pr for g in wanted if g.size <= n_workers])
    elif isinstance(classes, bool) or not isinstance(classes, int) or classes < 2:
        raise IparError(f"classes must be an integer >= 2 (the head's outputs), got {classes!r}.")
    bare = _layer_network(kind, layer, shape, classes, None)
    # a front Dense layer's own input: narrow (its weights are d x that), wide for every Pc
    front = input_gradient and _layer_network(kind, layer, shape, classes,
                                              max([16] + [g.pc for g in wanted]))
    report, todo = {}, []
    for grid in wanted:
        if grid.size > n_workers:
            report[str(grid)] = {"skipped": f"grid {grid} needs {grid.size} workers; the "
                                            f"cluster has {n_workers}."}
        elif front and _refusal(front, grid, batch) is None:
            todo.append((grid, front))
        elif (why := _refusal(bare, grid, batch)) is None:
            todo.append((grid, bare))
        else:
            report[str(grid)] = {"skipped": why}
        report.setdefault(str(grid), None)  # the grid order
    if not todo:
        reasons = "; ".join(f"{g}: {e['skipped']}" for g, e in report.items())
        raise IparError(f"no grid fits {layer!r} on input_shape={input_shape!r} with "
                        f"{n_workers} workers: {reasons}")
    run = dict(batch=batch, steps=steps, fd_eps=fd_eps, seed=seed, device=device,
               executor=executor, optimizer=optimizer or SGD(0.05, 0.9, 0.01))
    failures = []
    for grid, net in todo:
        layers = list(net["layers"])
        try:
            if kind == "dense":
                errors = compare_mlp(client, grid, sizes=(net["input"],), layers=layers, **run)
            else:
                errors = compare_cnn(client, grid, layers=layers, input_shape=net["input"],
                                     **run)
        except Exception as e:
            e.add_note(f"check_layer({layer!r}) on grid {grid}, network {net['text']}")
            raise
        try:
            _assert_errors(errors, grid, rtol, sgd_tol, fd_rtol, bytes_rtol)
        except AssertionError as e:
            failures.append(f"{e} [network {net['text']}; weights: {net['legend']}]")
        errors["network"] = tuple(layers)
        report[str(grid)] = errors
    if failures:
        raise AssertionError(f"check_layer({layer!r}) fails on {len(failures)} of "
                             f"{len(todo)} grids:\n  " + "\n  ".join(failures))
    return report


def _layer_input(layer, input_shape):
    """``("dense", features)`` or ``("front", (C, H, W))``; IparError naming what is wrong."""
    takes = "a dask_ipar Dense, Conv2d, MaxPool2d or AvgPool2d layer"
    if isinstance(layer, type):
        raise IparError(f"check_layer takes {takes} object, got the class {layer.__name__}; "
                        f"create one, e.g. {layer.__name__}(...) with its sizes.")
    if isinstance(layer, Flatten):
        raise IparError("Flatten() has no computation of its own to check (check_layer puts "
                        f"one after every conv or pooling layer); it takes {takes}.")
    if isinstance(layer, (list, tuple)):
        raise IparError(f"check_layer checks one layer, got a {type(layer).__name__} of "
                        f"{len(layer)}; pass {takes}, or use check_cnn for a network.")
    if not isinstance(layer, (Dense, Conv2d, MaxPool2d, AvgPool2d)):
        raise IparError(f"check_layer takes {takes}, got {type(layer).__name__} ({layer!r}).")

    def positive(v):
        return isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1

    name, is_seq = type(layer).__name__, isinstance(input_shape, (tuple, list))
    if isinstance(layer, Dense):
        if is_seq and len(input_shape) == 1:
            input_shape = input_shape[0]
        if not positive(input_shape):
            hint = (" (an image shape: a Dense layer takes the flattened C*H*W features)"
                    if is_seq and len(input_shape) == 3 else "")
            raise IparError(f"a {name} layer takes input_shape=<number of input features>, a "
                            f"positive integer; got {input_shape!r}{hint}.")
        return "dense", int(input_shape)
    if not is_seq or len(input_shape) != 3 or not all(positive(v) for v in input_shape):
        raise IparError(f"a {name} layer takes images: input_shape=(channels, height, width) "
                        f"of positive integers, got {input_shape!r}.")
    return "front", tuple(int(v) for v in input_shape)


def _parse_grids(grids):
    """The distinct grids of ``grids`` (one grid, or a list of them), in order."""
    if isinstance(grids, (str, Grid)):
        grids = [grids]
    if not isinstance(grids, (list, tuple)) or not grids:
        raise IparError(f"grids must be a non-empty list of grids such as ['1x1', '2x2'] "
                        f"(Pr x Pc), or None for all of them; got {grids!r}.")
    out = []
    for k, g in enumerate(grids):
        try:
            grid = parse_grid(g)
        except (ValueError, TypeError) as e:  # IparError is a ValueError
            raise IparError(f"grids[{k}] = {g!r}: {e}") from None
        out += [] if grid in out else [grid]
    return out


def _layer_network(kind, layer, shape, classes, front_inputs):
    """``{"layers", "input", "text", "legend", "model", "position"}`` of the network that
    runs ``layer``, with a shape-keeping layer with weights in front unless ``front_inputs``
    (a front Dense layer's input width at most) is None. None when the engine refuses the
    network with the front layer; IparError when it refuses the bare one."""
    lead = []
    if kind == "dense":
        if front_inputs is not None:
            lead, shape = [Dense(shape)], min(shape, front_inputs)
        layers, kwargs = lead + [layer, Dense(classes)], {"input_dim": shape}
    else:
        if front_inputs is not None:
            par = "batch" if getattr(layer, "parallel", "") == "batch" else "domain"
            lead = [Conv2d(shape[0], 1, padding="valid", parallel=par)]
        layers, kwargs = lead + [layer, Flatten(), Dense(classes)], {"input_shape": shape}
    try:
        model = Sequential(layers, dtype="float64", **kwargs)
    except IparError as e:
        if lead:
            return None
        what = "features" if kind == "dense" else "images"
        raise IparError(f"{layer!r} does not take {what} of input_shape={shape!r}: {e}") from None
    names = [f"front {type(lay).__name__}" for lay in lead] + ["your layer"]
    names += ["Flatten"] * (kind != "dense") + [f"head Dense({classes})"]
    weighted = [n for n, lay in zip(names, layers) if isinstance(lay, (Dense, Conv2d))]
    return {"layers": layers, "input": kwargs.popitem()[1], "text": " -> ".join(names),
            "legend": ", ".join(f"{k} = {n}" for k, n in enumerate(weighted)),
            "model": model, "position": len(lead)}


def _refusal(network, grid, batch):
    """Why the engine refuses ``network`` on ``grid`` for ``batch`` samples (None: it
    takes it): the checks of ``Sequential.distribute`` and of a step, without a cluster."""
    model = network["model"]
    try:
        check_dense_grid(model.dense_layers, model._first_dense, grid, model.sizes)
        check_batch(model._make_engine(fake_binding(grid)), grid, batch, batch)
    except ValueError as e:  # IparError is one
        return f"{e} (in the network {network['text']}, layer {network['position']} is yours)"
    return None
