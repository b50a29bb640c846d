"""``Sequential``: a dense network trained with the 1.5D scheme on a dask cluster."""

from __future__ import annotations

import asyncio
import importlib
import math
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from dask._task_spec import TaskRef

from dask_ipar.io.data import as_features, as_labels
from dask_ipar.kernels import dense as K
from dask_ipar.nn.engine import Engine, LayerLayout, StepGraph
from dask_ipar.errors import IparError
from dask_ipar.runtime.lineage import fold_finished_groups, missing_blocks, rekey_blocks
from dask_ipar.layout.grid import Grid, GridBinding, parse_grid
from dask_ipar.runtime.workers import bind_grid
from dask_ipar.nn.layers import AvgPool2d, Conv2d, Dense, Flatten, MaxPool2d
from dask_ipar.optim import SGD
from dask_ipar.layout.partition import split_bounds

__all__ = ["Sequential", "History", "StepStats"]


@dataclass
class StepStats:
    """What one training step reports: its batch, loss and the time it completed."""

    step: int
    batch: int
    loss: float
    accuracy: float
    done_s: float


@dataclass
class History:
    """Per-epoch training record returned by :meth:`Sequential.fit`."""

    epochs: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    #: Predicted beside measured communication (:class:`~dask_ipar.runtime.meter.CommReport`),
    #: when ``fit(measure=True)``.
    comm: object = None

    @property
    def last(self) -> dict:
        return self.epochs[-1] if self.epochs else {}


def _glorot(rng, n_out, n_in, dtype):
    lim = math.sqrt(6.0 / (n_in + n_out))
    return rng.uniform(-lim, lim, size=(n_out, n_in)).astype(dtype)


def _glorot_conv(rng, wshape, dtype):
    o, cg, kh, kw = wshape
    lim = math.sqrt(6.0 / (cg * kh * kw + o * kh * kw))
    return rng.uniform(-lim, lim, size=wshape).astype(dtype)


_FRONT = (Conv2d, MaxPool2d, AvgPool2d)


class Sequential:
    """A network ending in softmax cross-entropy: dense layers, or a CNN.

    An MLP is a list of :class:`~dask_ipar.nn.layers.Dense` layers. A CNN starts with
    :class:`~dask_ipar.nn.layers.Conv2d`, :class:`~dask_ipar.nn.layers.MaxPool2d` and
    :class:`~dask_ipar.nn.layers.AvgPool2d` layers (domain-parallel: image rows over
    ``Pr``, samples over ``Pc``), then :class:`~dask_ipar.nn.layers.Flatten`, then the
    dense layers (model-parallel over ``Pr``, batch-parallel over ``Pc``).

    Parameters
    ----------
    layers : list of layers
        The last layer produces the logits and must be a linear Dense layer.
    input_dim : int, optional
        Number of input features of an MLP; inferred from the first data seen if omitted.
    input_shape : (C, H, W), required for a CNN
        Image shape; data may come as ``(n, C, H, W)`` or flattened ``(n, C*H*W)``.
    dtype : {"float32", "float64"}
        Dtype of weights, activations and gradients.
    seed : int
        Seed of the weight initialization (Glorot uniform, zero biases).
    device : {"cpu", "cuda"}
        Where the blocks live: NumPy arrays in host memory, or CuPy arrays in the
        memory of each worker's GPU (needs ``pip install 'dask-ipar[gpu]'``). Data
        comes in and results go out as NumPy either way.

    Examples
    --------
    >>> from dask_ipar import Sequential, Dense
    >>> model = Sequential([Dense(32, "relu"), Dense(10)], input_dim=64)
    >>> model.sizes
    [64, 32, 10]
    >>> # model.distribute(client, "2x2").fit(X, y, epochs=5)   # doctest: +SKIP
    >>> cnn = Sequential([Conv2d(8, 3, activation="relu"), MaxPool2d(2), Flatten(),
    ...                   Dense(10)], input_shape=(1, 8, 8))
    >>> cnn.sizes
    [64, 512, 128, 128, 10]
    """

    def __init__(self, layers, input_dim: int | None = None, *, input_shape=None,
                 dtype="float32", seed: int = 0, device: str = "cpu"):
        layers = list(layers)
        if not layers:
            raise IparError("Sequential needs at least one layer, got an empty list.")
        n_front = 0
        while n_front < len(layers) and isinstance(layers[n_front], _FRONT):
            n_front += 1
        if n_front:
            if n_front == len(layers) or not isinstance(layers[n_front], Flatten):
                raise IparError(
                    f"layer {n_front} must be Flatten(): conv and pooling layers (layers "
                    f"0-{n_front - 1}) are followed by Flatten() and then Dense layers."
                )
            if input_shape is None:
                raise IparError("a CNN needs input_shape=(channels, height, width).")
        elif layers and isinstance(layers[0], Flatten):
            raise IparError("Flatten() comes after conv or pooling layers, not first.")
        for k, lay in enumerate(layers[n_front + bool(n_front):], start=n_front + bool(n_front)):
            if not isinstance(lay, Dense):
                what = ("conv and pooling layers come before Flatten()"
                        if isinstance(lay, _FRONT + (Flatten,)) else
                        "Sequential takes dask_ipar Dense, Conv2d, MaxPool2d, AvgPool2d and "
                        "Flatten layers")
                raise IparError(f"layer {k} is {type(lay).__name__}; {what}.")
        if input_shape is not None:
            if (not isinstance(input_shape, (tuple, list)) or len(input_shape) != 3
                    or not all(isinstance(v, int) and v >= 1 for v in input_shape)):
                raise IparError(
                    f"input_shape must be (channels, height, width) of positive integers, got "
                    f"{input_shape!r}."
                )
            if not n_front:
                raise IparError("input_shape is for CNNs; an MLP takes input_dim=.")
            input_shape = tuple(int(v) for v in input_shape)
            dim = input_shape[0] * input_shape[1] * input_shape[2]
            if input_dim is not None and input_dim != dim:
                raise IparError(f"input_dim={input_dim} contradicts input_shape={input_shape} "
                                f"({dim} features); give input_shape only.")
            input_dim = dim
        if not isinstance(layers[-1], Dense):
            raise IparError(f"the last layer must be Dense (the logits), got "
                            f"{type(layers[-1]).__name__}.")
        if layers[-1].activation != "linear":
            raise IparError(
                f"the last layer must be linear (it produces the logits; softmax is part of the "
                f"loss), got activation {layers[-1].activation!r}. Use Dense({layers[-1].units})."
            )
        if input_dim is not None and (not isinstance(input_dim, int) or input_dim < 1):
            raise IparError(f"input_dim must be a positive integer, got {input_dim!r}.")
        dt = np.dtype(dtype)
        if dt not in (np.float32, np.float64):
            raise IparError(f"dtype must be float32 or float64, got {dtype!r}.")
        if device != "cpu" and device not in K.DEVICE_MODULES:
            names = " or ".join(repr(d) for d in ("cpu", *K.DEVICE_MODULES))
            raise IparError(f"device must be {names}, got {device!r}.")
        if device == "cuda":
            try:
                import cupy  # noqa: F401
            except ImportError as exc:
                raise IparError(
                    "device='cuda' needs CuPy on the client and the workers: "
                    "pip install 'dask-ipar[gpu]'."
                ) from exc
        self.device = device
        #: array module of the blocks on the workers (None: NumPy); see :attr:`DEVICE_MODULES`
        self.block_module = K.DEVICE_MODULES.get(device)
        self.layers = tuple(layers)
        self.input_shape = input_shape
        self._n_front = n_front
        #: the Dense layers (after Flatten in a CNN)
        self.dense_layers = self.layers[n_front + bool(n_front):]
        self.input_dim = input_dim
        if n_front:
            from dask_ipar.nn.front import front_layouts

            self._shapes = front_layouts(self.layers[:n_front], input_shape, 1, 1)
        self.dtype = dt
        self.seed = seed
        self.uid = uuid.uuid4().hex[:8]
        self.client = None
        self.binding: GridBinding | None = None
        self.engine: Engine | None = None
        self._init_params = None
        self._w: list[str] | None = None
        self._v: list[str | None] | None = None
        self._futures: dict = {}
        self._roots: deque = deque(maxlen=4)
        self._amm_held = False  # whether distribute() stopped the scheduler's AMM
        self._closed = False  # close() was called: the state is gone, nothing rebuilds it
        self._step = 0
        #: Batches up to this many bytes (times Pr) travel inside the step graph.
        self.embed_bytes = 2**20
        #: Seconds between checks that every grid worker is still alive while waiting.
        self.liveness_check_s = 5.0
        #: Every this many training steps the weights and momentum get new keys without
        #: task history (:meth:`_cut_lineage`, one wait for the steps in flight); None
        #: never does. Each step's weights are computed from the step before, and dask
        #: keeps the records of finished tasks that lead to data still held: without the
        #: cut the workers and the scheduler keep every past step's (see
        #: :mod:`dask_ipar.runtime.lineage`).
        self.lineage_steps: int | None = 100
        #: How a training step runs: ``"programs"``, the step's kernels run as one dask
        #: task per worker that pushes the blocks to the other workers itself
        #: (:mod:`dask_ipar.runtime.programs`), or ``"graph"``, every kernel a dask task of its own
        #: (the dashboard's task stream shows each layer and phase, dask moves the
        #: blocks). The same results bit for bit and the same bytes moved; programs cost
        #: the scheduler a fraction of the work per step.
        self.executor: str = "programs"
        #: Seconds a worker program waits without receiving a block before it fails.
        self.program_timeout_s: float = 300.0
        self._exchange = None  # the client whose workers have the programs' plugin
        self._since_cut = 0  # training steps since the last cut
        self._cuts = 0
        self._meter = None

    # ---------------------------------------------------------------- shape
    @property
    def sizes(self) -> list[int]:
        """Layer widths ``[d_0, d_1, ..., d_L]`` (``d_0`` is None until known).

        For a CNN, conv and pooling layers count ``C*H*W`` of their output, Flatten the
        same as the layer before it.
        """
        front = []
        if self._n_front:
            front = [c * h * w for c, h, w in (f.out_shape for f in self._shapes)]
            front.append(front[-1])
        return [self.input_dim] + front + [lay.units for lay in self.dense_layers]

    @property
    def is_cnn(self) -> bool:
        return bool(self._n_front)

    @property
    def n_classes(self) -> int:
        return self.layers[-1].units

    @property
    def grid(self) -> Grid | None:
        return None if self.binding is None else self.binding.grid

    def __repr__(self):
        widths = "-".join(str(d) for d in self.sizes)
        where = "not distributed" if self.binding is None else f"grid {self.grid}"
        return f"Sequential({widths}, {self.dtype}, {where})"

    # ----------------------------------------------------------- placement
    def distribute(self, client, grid: Grid | str, workers: list[str] | None = None):
        """Bind the model to ``grid`` on ``client``'s workers (cell (i, j) -> one worker).

        Returns ``self``. Weights already on a previous grid are moved to the new one.
        """
        if self._closed:
            self._require_bound()  # raises: a closed model does not start afresh silently
        grid = parse_grid(grid)
        first = len(self.layers) - len(self.dense_layers)
        for k, lay in enumerate(self.dense_layers, start=first):
            if lay.units < grid.pr:
                raise IparError(
                    f"layer {k} has {lay.units} outputs, fewer than the grid's Pr = {grid.pr} rows; "
                    "each grid row must own at least one output row. Use a grid with "
                    f"Pr <= {min(l.units for l in self.dense_layers)}."
                )
        if self._n_front:
            from dask_ipar.nn.front import front_layouts

            front_layouts(self.layers[:self._n_front], self.input_shape, grid.pr, grid.pc)
        binding = bind_grid(grid, client, workers)
        params = self.get_weights() if self._w is not None else self._init_params
        self.drop_state()
        from dask_ipar.runtime.workers import hold_replicas

        self._amm_held = hold_replicas(client)
        self.client, self.binding = client, binding
        self._init_params = params
        if self.input_dim is not None:
            self._build()
        return self

    def _build(self):
        grid = self.binding.grid
        sizes = self.sizes
        first = len(self.layers) - len(self.dense_layers)
        for k, lay in enumerate(self.dense_layers, start=first):
            cols = sizes[k] + int(lay.bias)
            if cols < grid.pc:
                raise IparError(
                    f"layer {k} has {cols} weight columns (inputs + bias), fewer than the grid's "
                    f"Pc = {grid.pc} columns that share its weights. Use a grid with Pc <= {cols}."
                )
        layouts = [
            LayerLayout.build(k, sizes[k], lay, grid.pr, grid.pc)
            for k, lay in enumerate(self.dense_layers, start=first)
        ]
        front = None
        if self._n_front:
            from dask_ipar.nn.front import Front, front_layouts

            flayouts = front_layouts(self.layers[:self._n_front], self.input_shape, grid.pr,
                                     grid.pc)
            front = Front(self.binding, flayouts, f"flatten{self._n_front}", self.uid)
        self.engine = Engine(self.binding, layouts, self.uid, front=front)
        if self._init_params is None:
            rng = np.random.default_rng(self.seed)
            self._init_params = [
                (_glorot_conv(rng, f.wshape, self.dtype),
                 np.zeros(f.wshape[0], self.dtype) if f.weights.bias else None)
                for f in ([] if front is None else front.convs)
            ] + [
                (_glorot(rng, lay.units, sizes[k], self.dtype),
                 np.zeros(lay.units, self.dtype) if lay.bias else None)
                for k, lay in enumerate(self.dense_layers, start=first)
            ]
        self._scatter_weights(self._init_params)
        self._init_params = None

    def _require(self, n_features=None):
        self._require_bound()
        if self.engine is None:
            if self.input_dim is None:
                if n_features is None:
                    raise IparError("input_dim is unknown: pass input_dim= or fit on data first.")
                self.input_dim = n_features
            self._build()

    def _as_inputs(self, X):
        """Checked inputs: ``(n, features)``, or ``(n, C, H, W)`` images for a CNN."""
        if not self._n_front:
            return as_features(X, self.input_dim, self.dtype)
        shape = getattr(X, "shape", None)
        if shape is not None and len(shape) == 4:
            if tuple(shape[1:]) != self.input_shape:
                raise IparError(
                    f"images have shape {tuple(shape[1:])} (C, H, W), the model expects "
                    f"{self.input_shape} (input_shape)."
                )
            X = X.reshape(shape[0], -1)
        X = as_features(X, self.input_dim, self.dtype)
        return X.reshape(X.shape[0], *self.input_shape)

    def _next_step(self) -> int:
        self._step += 1
        return self._step

    def _keep(self, keys, futures):
        for k, f in zip(keys, futures):
            self._futures[k] = f

    def _release(self, names):
        if not names:
            return
        names = set(n for n in names if n is not None)
        for k in [k for k in self._futures if k[0] in names]:
            del self._futures[k]

    def _scatter_weights(self, params):
        """Place weight block (i, j) of every layer on cell (i, j); reset momentum."""
        step = self._next_step()
        per_worker: dict[str, dict] = {}
        names = []
        for lay, (W, b) in zip(self.engine.param_layouts, params):
            Wa = np.asarray(W, dtype=self.dtype).reshape(lay.n_out, lay.n_in)
            if b is not None:
                Wa = np.concatenate([Wa, np.asarray(b, dtype=self.dtype)[:, None]], axis=1)
            name = self.engine.name(lay.name, "w", step)
            names.append(name)
            for i, (r0, r1) in enumerate(lay.rows):
                for j, (c0, c1) in enumerate(lay.wcols):
                    per_worker.setdefault(self.binding.worker(i, j), {})[(name, i, j)] = (
                        np.ascontiguousarray(Wa[r0:r1, c0:c1])
                    )
        old = (self._w or []) + (self._v or [])
        if self.block_module:  # host blocks go up, then each owner copies its own to the GPU
            per_worker = {w: {(f"{k[0]}-host", *k[1:]): v for k, v in blocks.items()}
                          for w, blocks in per_worker.items()}
        scattered = {}
        for worker, blocks in per_worker.items():
            scattered.update(self.client.scatter(blocks, workers=[worker], hash=False,
                                                    direct=True))
        if self.block_module:
            g = StepGraph()
            keys = []
            for hkey in scattered:
                key = (hkey[0][: -len("-host")], *hkey[1:])
                g.add(key, self.binding.worker(*hkey[1:]), K.to_device, TaskRef(hkey),
                      self.block_module)
                keys.append(key)
            futs = self._submit(g, f"to-device-{self.uid}-s{step}", keys)
            scattered = dict(zip(keys, futs))
        self._futures.update(scattered)
        self._release(old)
        self._w = names
        self._v = [None] * len(names)

    def _place_batch(self, Xb: np.ndarray, yb: np.ndarray | None, step: int, g: StepGraph):
        """Put sample block j of a batch on every cell of grid column j (client to workers).

        Batches up to ``embed_bytes`` travel inside the step's graph (one message; the
        labels as arguments of the tasks that read them); larger ones are scattered
        straight to their workers. Either way the bytes go
        from the client to each worker and never between workers. The blocks are views of
        ``Xb`` where they can be (serialisation copies them); in-process workers would hold
        the caller's memory itself, so for them the batch is copied first.
        """
        if self.engine.in_process:
            Xb = np.array(Xb, copy=True)
            yb = None if yb is None else np.array(yb, copy=True)
        grid = self.binding.grid
        xname = f"input.x-{self.uid}-s{step}"
        yname = f"input.y-{self.uid}-s{step}"
        bounds = split_bounds(Xb.shape[0], grid.pc)
        labs = None if yb is None else [yb[b0:b1] for b0, b1 in bounds]
        blocks = {}
        layout = self.engine.front.input_layout if self._n_front else None
        if layout == "full":  # whole images of sample block j on every cell of column j
            for i, j in grid.cells():
                b0, b1 = bounds[j]
                blocks[(xname, i, j)] = np.ascontiguousarray(Xb[b0:b1])
            copies = grid.pr
        elif layout == "samples":  # whole images of sample block i of column j
            self.engine.front.check_batch(Xb.shape[0])
            sub = self.engine.front.samples(Xb.shape[0])
            for i, j in grid.cells():
                s0, s1 = sub[j][i]
                b0 = bounds[j][0]
                blocks[(xname, i, j)] = np.ascontiguousarray(Xb[b0 + s0:b0 + s1])
            copies = 1
        elif self._n_front:  # image strips: rows i of sample block j on cell (i, j)
            rows = split_bounds(Xb.shape[2], grid.pr)
            for i, j in grid.cells():
                (b0, b1), (r0, r1) = bounds[j], rows[i]
                blocks[(xname, i, j)] = np.ascontiguousarray(Xb[b0:b1, :, r0:r1])
            copies = 1
        else:
            # features x samples blocks as transposed views of the samples' rows: no copy
            # here (a transposing copy of a 16 MiB batch took the client 30-60 ms while
            # the workers computed); the kernels take either memory order
            cols = [np.ascontiguousarray(Xb[b0:b1]).T for b0, b1 in bounds]
            for i, j in grid.cells():
                blocks[(xname, i, j)] = cols[j]
            copies = grid.pr
        embed = Xb.nbytes * copies <= self.embed_bytes
        # labels of an embedded batch are arguments of the loss tasks themselves: no key of
        # their own, one scheduler task fewer per cell and step (their readers, the loss
        # gradient and statistics tasks, are on their cell; on row 0 both carry a copy,
        # a few bytes per sample, still from the client through the scheduler)
        inline_labels = labs is not None and embed and not self.block_module
        if labs is not None and not inline_labels:
            for i, j in grid.cells():
                blocks[(yname, i, j)] = labs[j]
        if embed:
            for key, value in blocks.items():
                g.add_data(key, self.binding.worker(*key[1:]), value)
            futures = {}
        else:
            futures = {}
            # labels first: dask reads a message's first array into the buffer of its
            # header (at any offset) and each later one into an allocation of its own, so
            # the input block then arrives aligned for BLAS (kernels copy misaligned ones)
            ordered = sorted(blocks.items(), key=lambda kv: kv[0][0] != yname)
            for i, j in grid.cells():
                mine = {k: v for k, v in ordered if k[1:] == (i, j)}
                futures.update(
                    self.client.scatter(mine, workers=[self.binding.worker(i, j)], hash=False,
                                        direct=True)
                )
        if self.block_module:  # each cell copies its block to its GPU: one task, no hop
            for key in blocks:
                g.add((key[0] + "-dev", *key[1:]), self.binding.worker(*key[1:]), K.to_device,
                      TaskRef(key), self.block_module)
            xname, yname = xname + "-dev", yname + "-dev"
        x_keys = {(i, j): TaskRef((xname, i, j)) for i, j in grid.cells()}
        if yb is None:
            y_keys = None
        elif inline_labels:
            y_keys = {(i, j): labs[j] for i, j in grid.cells()}
        else:
            y_keys = {(i, j): TaskRef((yname, i, j)) for i, j in grid.cells()}
        return x_keys, y_keys, futures

    def _fetch(self, keys, futures) -> list:
        """Results of ``futures`` (keys ``(name, i, j, ...)`` on cell (i, j)) as NumPy arrays.

        On GPUs each owner first copies its block to host memory, so the client
        never needs CuPy or a GPU to receive results.
        """
        if not self.block_module:
            return self._gather(list(futures))
        step = self._next_step()
        g = StepGraph()
        out = []
        for n, key in enumerate(keys):
            hkey = (f"host.fetch-{self.uid}-s{step}", n)
            g.add(hkey, self.binding.worker(*key[1:3]), K.to_host, TaskRef(key))
            out.append(hkey)
        fetched = self._submit(g, f"to-host-{self.uid}-s{step}", out)
        return self._gather(fetched)

    def _cut_lineage(self):
        """Give the weight and momentum blocks new keys that have no task history.

        Waits until the current blocks exist (the steps before have finished), then each
        worker stores its blocks under new keys as scattered data
        (:func:`~dask_ipar.runtime.lineage.rekey_blocks`: the same arrays, no copy, no transfer,
        no task), the scheduler learns of them as it does of scattered data, and the old
        keys are released. With no finished task feeding any data they still hold, the
        workers and the scheduler forget the records of all past steps; the model's
        finished task groups are folded (:func:`~dask_ipar.runtime.lineage.fold_finished_groups`).
        """
        from distributed import Future, wait

        self._since_cut = 0
        cells = self.binding.grid.cells()
        old = [n for n in self._w + self._v if n is not None]
        self._wait_alive([self._futures[(n, i, j)] for n in old for i, j in cells], self._step)
        self._cuts += 1  # new names end in -c<cut>: step numbers stay those of the steps
        rename, renames = {}, {}
        for n in old:
            owner, task = n.split("-", 1)[0].split(".", 1)
            rename[n] = new = f"{owner}.{task}-{self.uid}-c{self._cuts}"
            for i, j in cells:
                renames.setdefault(self.binding.worker(i, j), []).append(((n, i, j), (new, i, j)))
        # every worker must hold its blocks before any stores a new key: a worker that
        # stored some while another failed would keep keys the scheduler never frees
        missing = self.client.run(missing_blocks, renames, workers=list(renames))
        gone = [k for keys in missing.values() for k in keys]
        if gone:
            self._check_alive(self._step)
            raise IparError(f"weight blocks {gone[:3]} are no longer on their workers; "
                            "the model's state is lost (restore from a checkpoint).")
        # futures first: the scheduler reports the keys to the client as soon as it knows them
        futures = {new: Future(new, self.client) for pairs in renames.values() for _, new in pairs}
        nbytes = self.client.run(rekey_blocks, renames, workers=list(renames))
        self.client.sync(
            self.client.scheduler.update_data,
            who_has={k: [w] for w, blocks in nbytes.items() for k in blocks},
            nbytes={k: b for blocks in nbytes.values() for k, b in blocks.items()},
            client=self.client.id,
        )
        try:
            wait(list(futures.values()), timeout=120)
        except TimeoutError:
            raise IparError(
                "the scheduler did not confirm the re-keyed weight blocks within 120 s; "
                "check that every grid worker is alive (the dashboard's Workers page)."
            ) from None
        self._keep(list(futures), list(futures.values()))
        self._release(old)
        self._w = [rename[n] for n in self._w]
        self._v = [None if n is None else rename[n] for n in self._v]
        self.client.run_on_scheduler(fold_finished_groups, self.uid)

    def _submit(self, graph, name, keys, step=None, first=()):
        """Submit ``graph``; futures of ``keys``. The graph's roots (prefetch tasks) are
        computed too, their futures held until the next submission.

        With ``step`` and ``executor == "programs"`` the graph runs as worker programs
        (:func:`dask_ipar.runtime.programs.compile_programs`; the prefetches happen inside them):
        per worker one program for what ``first`` needs (the forward pass and the loss
        statistics), one for the rest of the step.
        """
        if step is not None and self._use_programs():
            from dask_ipar.runtime.programs import compile_programs

            hlg, _, orphans = compile_programs(graph, list(keys), self._locate, name,
                                               f"{self.uid}-s{step}", self.program_timeout_s,
                                               first)
            futs = self.client.get(hlg, list(keys) + orphans, sync=False)
            if orphans:  # programs that only send: held like the prefetches
                self._roots.append(futs[len(keys):])
            return futs[:len(keys)]
        futs = self.client.get(graph.to_hlg(name), list(keys) + graph.roots, sync=False)
        if graph.roots:  # released four submissions later: by then they have run
            self._roots.append(futs[len(keys):])
        return futs[:len(keys)]

    def _use_programs(self) -> bool:
        """Whether steps run as worker programs (checks the setting; installs the plugin)."""
        if self.executor not in ("graph", "programs"):
            raise IparError(f"executor is {self.executor!r}, expected 'graph' or 'programs'.")
        if self.executor == "graph":
            return False
        if self._exchange is not self.client:
            from dask_ipar.runtime.programs import install_exchange

            install_exchange(self.client)
            self._exchange = self.client
        return True

    def abort_programs(self, reason: str) -> None:
        """Make this model's worker programs that are waiting for blocks fail now with
        ``reason`` (called when a grid worker has left; nothing when none ever ran)."""
        if self._exchange is not None:
            from dask_ipar.runtime.programs import abort_programs

            abort_programs(self.client, self.uid, reason)

    def _locate(self, key):
        """The worker of an existing block ``(name, i, j, ...)``: that of cell (i, j)."""
        try:
            return self.binding.worker(key[1], key[2])
        except (TypeError, IndexError, KeyError) as exc:
            raise IparError(f"no grid cell for key {key!r}; keys of existing blocks are "
                            "(name, i, j, ...).") from exc

    # ------------------------------------------------------------ training
    def _min_samples(self) -> int:
        """Fewest samples a step takes: one per grid column, or per cell with batch-parallel
        conv layers (they split each column's samples over Pr as well)."""
        grid = self.binding.grid
        front = None if self.engine is None else self.engine.front
        return grid.size if front is not None and front.has_batch else grid.pc

    def _check_batch(self, batch_size, n):
        pc = self.binding.grid.pc
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise IparError(f"batch_size must be a positive integer, got {batch_size!r}.")
        least = self._min_samples()
        if least > pc and min(batch_size, n) < least:
            raise IparError(
                f"batch size {min(batch_size, n)} is smaller than the {least} cells of grid "
                f"{self.binding.grid}; the batch-parallel conv layers need a sample on every "
                f"cell. Use a batch of at least {least}."
            )
        if batch_size < pc:
            raise IparError(
                f"batch size {batch_size} is smaller than the grid's Pc = {pc} batch-parallel "
                f"columns; every column needs at least one sample. Use a batch of at least {pc} "
                f"or a grid with Pc <= {batch_size}."
            )
        if n < pc:
            raise IparError(f"{n} samples cannot be split over Pc = {pc} grid columns.")
        return min(batch_size, n)

    def train_step(self, Xb, yb, optimizer: SGD):
        """Submit one SGD step on a prepared batch; returns the loss-statistics futures."""
        self._require()
        if self.lineage_steps is not None and self._since_cut >= self.lineage_steps:
            self._cut_lineage()
        self._since_cut += 1
        step = self._next_step()
        g = StepGraph()
        x_keys, y_keys, data = self._place_batch(Xb, yb, step, g)
        g, new_w, new_v, stats = self.engine.train_step(
            x_keys, y_keys, Xb.shape[0], self._w, self._v, step,
            optimizer.lr, optimizer.momentum, optimizer.weight_decay, g=g,
        )
        # momentum blocks updated in place keep their names (and futures)
        fresh = [n for n in new_w + new_v if n not in self._v]
        keys = [(n, i, j) for n in fresh for i, j in self.binding.grid.cells()]
        futs = self._submit(g, f"step-{self.uid}-s{step}", keys + stats, step=step,
                            first=stats)
        self._keep(keys, futs[: len(keys)])
        self._release([n for n in self._w + self._v if n not in new_v])
        self._w, self._v = new_w, new_v
        del data  # the graph holds the batch now
        return futs[len(keys):]

    def fit(self, X, y, *, epochs: int = 1, batch_size: int = 32, optimizer: SGD | None = None,
            shuffle: bool = True, seed: int | None = None, progress=False,
            max_inflight: int = 2, measure: bool = True, machine=None) -> History:
        """Train with minibatch SGD; returns a :class:`History` of per-epoch loss and accuracy.

        Parameters
        ----------
        X : array (n_samples, n_features), NumPy or dask
        y : array (n_samples,) of integer labels in ``[0, classes)``
        epochs, batch_size : int
            Batches with fewer samples than grid columns (a short last batch) are dropped.
        optimizer : SGD
        progress : bool or callable
            True shows a tqdm bar (loss, accuracy, samples/s) on stderr; a callable
            gets each :class:`StepStats`.
        max_inflight : int
            Steps submitted ahead of the one being waited for (hides graph build and
            data transfer behind compute).
        measure : bool
            Drain the workers' transfer logs (every 32 steps and at each epoch end) and
            put the per-layer, per-phase predicted-vs-measured table in ``history.comm``.
        machine : dask_ipar.cost.Machine, optional
            Alpha-beta figures for the predicted seconds (default: rough loopback values).
        """
        optimizer = optimizer or SGD()
        if not isinstance(epochs, int) or epochs < 1:
            raise IparError(f"epochs must be a positive integer, got {epochs!r}.")
        self._require_bound()
        X = self._as_inputs(X)
        y = as_labels(y, X.shape[0], self.n_classes)
        self._require(X.shape[1])
        batch = self._check_batch(batch_size, X.shape[0])
        rng = np.random.default_rng(self.seed if seed is None else seed)
        n = X.shape[0]
        pc = self._min_samples()  # batches with fewer samples are skipped
        history = History()
        bar = _make_bar(progress, epochs * (n // batch + (n % batch >= pc)))
        callback = progress if callable(progress) else None
        meter = None
        if measure:
            from dask_ipar.runtime.meter import CommMeter

            meter = CommMeter(self.client, self.binding, self.engine,
                              self.dtype.itemsize, machine)
        self._meter = meter
        try:
            for epoch in range(epochs):
                t0 = time.perf_counter()
                order = rng.permutation(n) if shuffle else np.arange(n)
                pending: deque = deque()
                totals = np.zeros(3)
                for start in range(0, n, batch):
                    idx = order[start:start + batch]
                    if len(idx) < pc:
                        continue
                    stats = self.train_step(X[idx], y[idx], optimizer)
                    pending.append((self._step, len(idx), stats))
                    while len(pending) > max_inflight:
                        self._finish(pending.popleft(), totals, history, bar, callback, t0)
                while pending:
                    self._finish(pending.popleft(), totals, history, bar, callback, t0)
                secs = time.perf_counter() - t0
                # The loss statistics arrive after the forward pass: wait for the last
                # step's update too, so an epoch (and fit) ends when training has.
                from distributed import wait

                wait([self._futures[(name, i, j)] for name in self._w + self._v
                      for i, j in self.binding.grid.cells()])
                if meter is not None:
                    meter.drain()
                history.epochs.append({
                    "epoch": epoch + 1,
                    "loss": totals[0] / totals[2],
                    "accuracy": totals[1] / totals[2],
                    "seconds": secs,
                    "samples_per_s": totals[2] / secs,
                })
        finally:
            if bar is not None:
                bar.close()
            self._meter = None
        if meter is not None:
            history.comm = meter.report()
        return history

    def _check_alive(self, step):
        """Raise a clear error if a worker of the grid has left the cluster."""
        from dask_ipar.runtime.workers import scheduler_workers

        alive = set(scheduler_workers(self.client))
        gone = [(cell, w) for cell in self.binding.grid.cells()
                if (w := self.binding.worker(*cell)) not in alive]
        if gone:
            cell, w = gone[0]
            self.abort_programs(f"worker {w} of grid cell {cell} left the cluster")
            raise IparError(
                f"worker {w} of grid cell {cell} left the cluster during step {step}; the blocks "
                "it held are lost, so training stops here. Save checkpoints "
                "(dask_ipar.io.checkpoint or `dask-ipar train --checkpoint-dir DIR`) and resume "
                "from the last one (`--resume`) on the restarted cluster."
            )

    def _wait_alive(self, futs, step):
        """Wait for ``futs``, checking every few seconds that the grid is intact."""
        from distributed import wait

        while True:
            try:
                wait(futs, timeout=self.liveness_check_s)
                return
            except TimeoutError:
                self._check_alive(step)

    def _gather_step(self, futs, step):
        """Wait for a step's results, checking every few seconds that the grid is intact.

        Tasks are pinned to their cells, so a step whose worker died would otherwise wait
        forever; one whose data was lost fails with dask's cancellation error.
        """
        try:
            self._wait_alive(futs, step)
            return self.client.gather(futs)
        except IparError:
            raise
        except Exception:  # e.g. futures cancelled because their inputs were lost
            self._check_alive(step)
            raise

    def _finish(self, item, totals, history, bar, callback, t0):
        step, nb, futs = item
        loss_sum, correct = np.sum(self._gather_step(futs, step), axis=0)
        if not np.isfinite(loss_sum):
            raise IparError(
                f"training diverged at step {step}: the loss is {loss_sum}. "
                "Lower the learning rate or standardize the inputs."
            )
        totals += (loss_sum, correct, nb)
        if self._meter is not None:
            self._meter.add_step(nb)
            if step % 32 == 0:  # the logs hold far more; fit drains them at each epoch end
                self._meter.drain()
        st = StepStats(step, nb, loss_sum / nb, correct / nb, time.perf_counter())
        history.steps.append(st)
        if bar is not None:
            el = time.perf_counter() - t0
            bar.set_postfix(loss=f"{totals[0] / totals[2]:.4f}",
                            acc=f"{totals[1] / totals[2]:.3f}",
                            samples_s=f"{totals[2] / max(el, 1e-9):.0f}", refresh=False)
            bar.update(1)
        if callback is not None:
            callback(st)

    def _require_bound(self):
        """Raise a clear error unless the model is on a cluster with its state intact."""
        if self._closed:
            raise IparError(
                "this model was closed (model.close()): its weights and momentum were released "
                "from the cluster and are gone. Save a checkpoint or call get_weights() before "
                "closing; to go on, build a new model and load a checkpoint into it."
            )
        if self.binding is None:
            raise IparError(
                "the model is not on a cluster yet: call model.distribute(client, grid) first."
            )
        if self._w is not None:
            cells = self.binding.grid.cells()
            for name in self._w + self._v:
                if name is None:
                    continue
                for c in cells:
                    f = self._futures.get((name, *c))
                    status = "missing" if f is None else f.status
                    if status in ("pending", "finished"):
                        continue
                    self._raise_lost(f"its block {name} of grid cell {c} is {status}", f)

    def _raise_lost(self, what: str, future=None, grace_s: float = 0.0):
        """Raise the error of a model whose blocks are gone: the grid worker that left,
        if one did (waiting up to ``grace_s`` for the scheduler to notice), else the
        failed task's own error, else ``what``."""
        from dask_ipar.runtime.workers import scheduler_workers

        deadline = time.monotonic() + grace_s
        while True:
            alive = set(scheduler_workers(self.client))
            gone = [(c, w) for c in self.binding.grid.cells()
                    if (w := self.binding.worker(*c)) not in alive]
            if gone or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if gone:
            c, w = gone[0]
            self.abort_programs(f"worker {w} of grid cell {c} left the cluster")
            what = f"worker {w} of grid cell {c} left the cluster (restarted or died)"
        elif future is not None and future.status == "error":
            raise future.exception()  # a failed step: its own error, not a guess
        raise IparError(f"the model's state on the cluster is lost: {what}. Restore it from a "
                        "checkpoint: checkpoint.recover(model, directory) or "
                        "`dask-ipar train --resume`.")

    def _gather(self, futures):
        """``client.gather`` that turns blocks cancelled under it (a worker died, the
        workers were restarted) into the model's one clear error."""
        from distributed.client import FutureCancelledError

        try:
            return self.client.gather(futures)
        except (FutureCancelledError, asyncio.CancelledError):
            self._raise_lost("its blocks were cancelled on the cluster", grace_s=10.0)

    # ----------------------------------------------------------- inference
    def _batches(self, X, y, batch_size):
        n = X.shape[0]
        batch = n if batch_size is None else self._check_batch(batch_size, n)
        pc = self._min_samples()
        if n < pc:
            raise IparError(f"{n} samples cannot be split over the grid's {pc} "
                            f"{'columns' if pc == self.binding.grid.pc else 'cells'}.")
        starts = list(range(0, n, batch))
        if len(starts) > 1 and n - starts[-1] < pc:  # fold a too-short tail into its neighbour
            starts.pop()
        for k, s in enumerate(starts):
            e = starts[k + 1] if k + 1 < len(starts) else n
            yield X[s:e], None if y is None else y[s:e]

    def _forward_batch(self, Xb, yb):
        step = self._next_step()
        g = StepGraph()
        x_keys, y_keys, data = self._place_batch(Xb, yb, step, g)
        g, logit_keys, stats = self.engine.forward(x_keys, self._w, step, y_keys, g=g,
                                                   batch=Xb.shape[0])
        futs = self._submit(g, f"fwd-{self.uid}-s{step}", logit_keys + stats)
        return futs, logit_keys

    def forward(self, X, batch_size: int | None = 4096) -> np.ndarray:
        """Logits ``(n_samples, classes)``, computed on the grid batch by batch."""
        self._require_bound()
        X = self._as_inputs(X)
        self._require(X.shape[1])
        out = []
        for Xb, _ in self._batches(X, None, batch_size):
            futs, keys = self._forward_batch(Xb, None)
            out.extend(self._fetch(keys, futs))
        return np.concatenate([np.asarray(o).T for o in out], axis=0)

    def predict(self, X, batch_size: int | None = 4096) -> np.ndarray:
        """Predicted class of every sample."""
        return self.forward(X, batch_size).argmax(axis=1)

    def evaluate(self, X, y, batch_size: int | None = 4096) -> dict:
        """Mean cross-entropy ``loss`` and ``accuracy`` on ``(X, y)``."""
        self._require_bound()
        X = self._as_inputs(X)
        y = as_labels(y, X.shape[0], self.n_classes)
        self._require(X.shape[1])
        totals = np.zeros(2)
        for Xb, yb in self._batches(X, y, batch_size):
            futs, keys = self._forward_batch(Xb, yb)
            totals += np.sum(self._gather(futs[len(keys):]), axis=0)
        return {"loss": totals[0] / len(y), "accuracy": totals[1] / len(y)}

    def gradients(self, X, y):
        """Loss, accuracy and gradients ``[(dW, db), ...]`` of the mean loss over all of ``X``.

        Computed on the grid exactly as a training step does, without the update.
        """
        self._require_bound()
        X = self._as_inputs(X)
        y = as_labels(y, X.shape[0], self.n_classes)
        self._require(X.shape[1])
        self._check_batch(X.shape[0], X.shape[0])
        step = self._next_step()
        g = StepGraph()
        x_keys, y_keys, data = self._place_batch(X, y, step, g)
        g, names, stats = self.engine.gradient(x_keys, y_keys, X.shape[0], self._w, step, g=g)
        keys = [(n, i, j) for n in names for i, j in self.binding.grid.cells()]
        futs = self._submit(g, f"grad-{self.uid}-s{step}", keys + stats)
        blocks = dict(zip(keys, self._fetch(keys, futs[: len(keys)])))
        loss_sum, correct = np.sum(self._gather(futs[len(keys):]), axis=0)
        grads = [self._assemble(lay, name, blocks) for lay, name in zip(self.engine.param_layouts, names)]
        return loss_sum / len(y), correct / len(y), grads

    # -------------------------------------------------------------- weights
    def _assemble(self, lay, name, blocks):
        grid = self.binding.grid
        full = np.concatenate([
            np.concatenate([np.asarray(blocks[(name, i, j)]) for j in range(grid.pc)], axis=1)
            for i in range(grid.pr)
        ], axis=0)
        W = full[:, : lay.n_in]
        if lay.name.startswith("conv"):
            W = W.reshape(self._wshape(lay))
        return (W, full[:, lay.n_in] if lay.bias else None)

    def _wshape(self, lay):
        """Shape of a layer's ``W`` as users see it (filters for a conv)."""
        if self.engine is not None and self.engine.front is not None:
            for f in self.engine.front.convs:
                if f.weights.name == lay.name:
                    return f.wshape
        return (lay.n_out, lay.n_in)

    def weight_arrays(self):
        """The master weights as dask arrays (``d_out x (d_in + bias)``), block (i, j) on cell (i, j).

        Computing one gathers it to the client. The next training step rewrites the
        weight blocks in place: compute (or copy) the arrays before submitting it.
        """
        import dask.array as da

        self._require()
        out = []
        for lay, name in zip(self.engine.param_layouts, self._w):
            dsk = {(name, i, j): self._futures[(name, i, j)] for i, j in self.binding.grid.cells()}
            chunks = (tuple(b - a for a, b in lay.rows), tuple(b - a for a, b in lay.wcols))
            meta = np.empty((0, 0), dtype=self.dtype)
            if self.block_module:
                xp = importlib.import_module(self.block_module)
                meta = xp.empty((0, 0), dtype=getattr(xp, self.dtype.name))
            out.append(da.Array(dsk, name, chunks, meta=meta))
        return out

    def get_weights(self):
        """``[(W, b), ...]`` as NumPy arrays (``W`` is ``d_out x d_in``), gathered to the client."""
        self._require_bound()
        if self._w is None:
            if self._init_params is None:
                self._require()
            else:
                return [(W.copy(), None if b is None else b.copy()) for W, b in self._init_params]
        keys = [(n, i, j) for n in self._w for i, j in self.binding.grid.cells()]
        blocks = dict(zip(keys, self._fetch(keys, [self._futures[k] for k in keys])))
        return [self._assemble(lay, name, blocks) for lay, name in zip(self.engine.param_layouts, self._w)]

    def set_weights(self, params):
        """Replace all weights (``[(W, b), ...]``, ``W`` is ``d_out x d_in``); resets momentum."""
        self._require()
        params = list(params)
        layouts = self.engine.param_layouts
        if len(params) != len(layouts):
            raise IparError(f"expected {len(layouts)} (W, b) pairs (one per layer with weights), "
                            f"got {len(params)}.")
        checked = []
        for k, (lay, (W, b)) in enumerate(zip(layouts, params)):
            W = np.asarray(W)
            if W.shape != self._wshape(lay):
                raise IparError(
                    f"layer {lay.index} ({lay.name}): W has shape {W.shape}, expected "
                    f"{self._wshape(lay)} "
                    + ("(filters, channels / groups, kh, kw)." if lay.name.startswith("conv")
                       else "(d_out x d_in).")
                )
            if lay.bias:
                if b is None or np.shape(b) != (lay.n_out,):
                    raise IparError(
                        f"layer {k}: bias has shape {np.shape(b)}, expected ({lay.n_out},)."
                    )
            checked.append((W, b))
        self._scatter_weights(checked)

    # ----------------------------------------------------- step-time model
    def predict_step_s(self, batch: int, machine, *, cores: int | None = None,
                       optimizer: SGD | None = None):
        """Predicted seconds of one training step on this grid, by simulating its task graph.

        ``machine`` is a :class:`dask_ipar.cost.Machine` from ``dask-ipar calibrate``
        (``alpha_s`` = seconds per dependent hop, ``bandwidth_Bps``, ``flops_per_s``);
        ``cores`` shared by the workers (default: one per worker). Returns a
        :class:`dask_ipar.cost.SimResult`. Nothing is submitted.
        """
        from dask_ipar.cost import simulate_step
        from dask_ipar.nn.engine import sim_tasks

        self._require()
        if self._n_front:
            raise IparError("step-time prediction covers dense networks only, not conv layers "
                            "yet.")
        if not machine.flops_per_s:
            raise IparError("the machine needs flops_per_s (run `dask-ipar calibrate`).")
        grid = self.binding.grid
        g = StepGraph()
        bounds = split_bounds(batch, grid.pc)
        x_keys, y_keys = {}, {}
        for i, j in grid.cells():
            b = bounds[j][1] - bounds[j][0]
            w = self.binding.worker(i, j)
            x_keys[(i, j)] = g.add_data(("sim.x", i, j), w, np.zeros((self.input_dim, b),
                                                                     self.dtype))
            y_keys[(i, j)] = g.add_data(("sim.y", i, j), w, np.zeros(b, np.int64))
        v_names = [f"sim.v{k}" for k in range(len(self.layers))]
        opt = optimizer or SGD()
        g, _, _, _ = self.engine.train_step(x_keys, y_keys, batch, self._w, v_names, 0,
                                            opt.lr, opt.momentum, opt.weight_decay, g=g)
        external = {}
        for lay, wn, vn in zip(self.engine.param_layouts, self._w, v_names):
            for i, (r0, r1) in enumerate(lay.rows):
                for j, (c0, c1) in enumerate(lay.wcols):
                    for name in (wn, vn):
                        external[(name, i, j)] = (self.binding.worker(i, j), (r1 - r0, c1 - c0))
        tasks, available = sim_tasks(g, external, self.dtype.itemsize)
        return simulate_step(tasks, flops_per_s=machine.flops_per_s,
                             bandwidth_Bps=machine.bandwidth_Bps, hop_s=machine.alpha_s,
                             cores=cores, available=available, task_s=machine.task_s or 0.0,
                             cluster_flops_per_s=machine.cluster_flops_per_s,
                             cluster_mem_Bps=machine.mem_Bps,
                             cluster_bandwidth_Bps=machine.cluster_bandwidth_Bps)

    # ------------------------------------------------------- state blocks
    def state_blocks(self) -> dict:
        """Where the training state lives, block by block (for checkpoints).

        Returns ``{"step", "grid": (pr, pc), "dtype", "layers": [...]}`` where each
        layer is ``{"name", "n_in", "n_out", "bias", "activation", "rows", "wcols",
        "w": {(i, j): Future}, "v": {(i, j): Future} or None, "workers": {(i, j): addr}}``.
        Weight block ``(i, j)`` holds rows ``rows[i]`` and columns ``wcols[j]`` of the
        ``n_out x (n_in + bias)`` matrix whose last column is the bias; ``v`` is the
        momentum buffer of the same shape (None before the first step). A step's
        update rewrites the weight and momentum blocks in place: they hold that step's
        values once the weight futures have finished, so wait for those before reading
        the momentum, and read both before submitting another step.
        """
        self._require()
        cells = self.binding.grid.cells()
        layers = []
        for lay, wn, vn in zip(self.engine.param_layouts, self._w, self._v):
            layers.append({
                "name": lay.name, "n_in": lay.n_in, "n_out": lay.n_out, "bias": lay.bias,
                "activation": lay.activation, "rows": lay.rows, "wcols": lay.wcols,
                "w": {c: self._futures[(wn, *c)] for c in cells},
                "v": None if vn is None else {c: self._futures[(vn, *c)] for c in cells},
                "workers": {c: self.binding.worker(*c) for c in cells},
            })
        return {"step": self._step, "grid": (self.binding.grid.pr, self.binding.grid.pc),
                "dtype": str(self.dtype), "layers": layers}

    def reserve_state_keys(self, with_velocity: bool):
        """Key names for a new full set of state blocks: ``(w_names, v_names)``.

        Block ``(i, j)`` of layer ``l`` must be stored under key ``(w_names[l], i, j)``
        on worker ``binding.worker(i, j)``; then hand the futures to :meth:`adopt_state`.
        """
        self._require()
        step = self._next_step()
        w = [self.engine.name(lay.name, "w", step) for lay in self.engine.param_layouts]
        v = ([self.engine.name(lay.name, "v", step) for lay in self.engine.param_layouts]
             if with_velocity else [None] * len(w))
        return w, v

    def adopt_state(self, w_names, v_names, futures: dict):
        """Make the blocks in ``futures`` (keyed ``(name, i, j)``) the model's state."""
        cells = self.binding.grid.cells()
        need = {(n, *c) for n in list(w_names) + list(v_names) if n is not None for c in cells}
        missing = need - set(futures)
        if missing:
            raise IparError(f"state blocks missing for {len(missing)} keys, e.g. {min(missing)}.")
        old = (self._w or []) + (self._v or [])
        self._futures.update({k: futures[k] for k in need})
        self._release([n for n in old if n not in set(w_names) | set(v_names)])
        self._w, self._v = list(w_names), list(v_names)

    def close(self):
        """Release every block this model holds on the cluster (steps still running as
        worker programs stop). The weights are gone with them: afterwards every method
        that needs them (``fit``, ``get_weights``, ``evaluate``, ``distribute``,
        ``checkpoint.save``, ...) raises an error saying the model was closed."""
        self.drop_state()
        self._closed = True

    def drop_state(self):
        """Release every block this model holds on the cluster, keeping it usable: the
        next use builds the initial weights again, unless state is loaded first (what
        :func:`dask_ipar.io.checkpoint.recover` does after a worker died)."""
        if self._futures and self._exchange is not None:
            self.abort_programs("the model was closed")
        self._exchange = None
        self._futures.clear()
        self._roots.clear()
        self._w = self._v = None
        self.engine = None
        if self._amm_held:
            from dask_ipar.runtime.workers import release_replicas

            self._amm_held = False
            release_replicas(self.client)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _make_bar(progress, total):
    if progress is not True:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with the train extra
        return None
    return tqdm(total=total, unit="step", dynamic_ncols=True, leave=True)
