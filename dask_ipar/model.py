"""``Sequential``: a dense network trained with the 1.5D scheme on a dask cluster."""

from __future__ import annotations

import uuid

import numpy as np

from dask_ipar.io.data import as_inputs
from dask_ipar.kernels import blocks as B
from dask_ipar.nn.dense import Engine
from dask_ipar.nn.dense_layout import LayerLayout, check_dense_grid
from dask_ipar.nn.front import Front, front_layouts
from dask_ipar.nn.graph import StepGraph
from dask_ipar.errors import IparError
from dask_ipar.runtime import inference
from dask_ipar.runtime.exchange import abort_programs
from dask_ipar.runtime.executors import GraphExecutor, make_executor
from dask_ipar.runtime.placement import batches, check_batch, min_samples, place_batch
from dask_ipar.runtime.state import BlockStore
from dask_ipar.runtime.stepmodel import predict_step_s
from dask_ipar.runtime.loop import History, StepStats
from dask_ipar.runtime.training import fit as _fit, submit_step
from dask_ipar.runtime.weights import (assemble, check_params, initial_params, weight_arrays,
                                       weight_shape)
from dask_ipar.layout.grid import Grid, GridBinding, parse_grid
from dask_ipar.runtime.workers import bind_grid
from dask_ipar.nn.layers import AvgPool2d, Conv2d, Dense, Flatten, MaxPool2d  # noqa: F401 (doctests)
from dask_ipar.nn.layers import check_network
from dask_ipar.optim import SGD

__all__ = ["Sequential", "History", "StepStats"]


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
        n_front, input_dim, input_shape = check_network(layers, input_dim, input_shape)
        dt = B.check_device(device, dtype)
        self.device = device
        self.layers = tuple(layers)
        self.input_shape = input_shape
        self._n_front = n_front
        #: the Dense layers (after Flatten in a CNN)
        self.dense_layers = self.layers[n_front + bool(n_front):]
        self.input_dim = input_dim
        if n_front:
            self._shapes = front_layouts(self.layers[:n_front], input_shape, 1, 1)
        self.dtype = dt
        self.seed = seed
        self.uid = uuid.uuid4().hex[:8]
        self.client = None
        self.binding: GridBinding | None = None
        self.engine: Engine | None = None
        self._init_params = self._init_velocity = None
        self._store: BlockStore | None = None  # the blocks on the cluster (distribute)
        self._executor = None  # made from ``executor`` on first use (:meth:`_submit`)
        self._programs_on = None  # the client whose workers ran this model's programs
        self._amm_held = False  # whether distribute() stopped the scheduler's AMM
        self._closed = False  # close() was called: the state is gone, nothing rebuilds it
        self._step = 0
        #: Batches up to this many bytes (times Pr) travel inside the step graph.
        self.embed_bytes = 2**20
        #: Seconds between checks that every grid worker is still alive while waiting.
        self.liveness_check_s = 5.0
        #: Every this many steps (up to twice as many: steps.submit_steps) the state gets new
        #: keys without task history (:mod:`dask_ipar.runtime.lineage`); None: never.
        self.lineage_steps: int | None = 100
        #: How a training step runs (:mod:`dask_ipar.runtime.executors`): ``"programs"``
        #: (one dask task per worker and phase, pushing blocks itself) or ``"graph"`` (a
        #: task per kernel, each layer and phase in the dashboard). Same results bit for
        #: bit, same bytes; programs cost the scheduler a fraction of the work.
        self.executor: str = "programs"
        #: Seconds a worker program waits without receiving a block before it fails.
        self.program_timeout_s: float = 300.0
        self._since_cut = 0  # training steps since the last cut
        #: Input standardization (:class:`dask_ipar.io.scaling.Standardizer`) applied to
        #: every input of ``fit``, ``predict``, ``evaluate`` and ``gradients``, or None.
        self.scaling = None

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
    def block_module(self) -> str | None:
        """Array module of the blocks on the workers (None: NumPy); see
        :data:`dask_ipar.kernels.blocks.DEVICE_MODULES`."""
        return B.DEVICE_MODULES.get(self.device)

    # the state store's keys, under the names the rest of the package reads
    _w = property(lambda self: None if self._store is None else self._store.w)
    _v = property(lambda self: None if self._store is None else self._store.v)
    _futures = property(lambda self: {} if self._store is None else self._store.futures)
    _cuts = property(lambda self: 0 if self._store is None else self._store.cuts)

    @property
    def _first_dense(self) -> int:
        """Index of the first Dense layer in :attr:`layers`."""
        return len(self.layers) - len(self.dense_layers)

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

        Returns ``self``. Weights already on a previous grid are moved to the new one,
        with their momentum.
        """
        if self._closed:
            self._require_bound()  # raises: a closed model does not start afresh silently
        grid = parse_grid(grid)
        check_dense_grid(self.dense_layers, self._first_dense, grid)
        if self._n_front:
            front_layouts(self.layers[:self._n_front], self.input_shape, grid.pr, grid.pc)
        binding = bind_grid(grid, client, workers)
        params = self.get_weights() if self._w is not None else self._init_params
        velocity = None  # the momentum comes along to the new grid, as through a checkpoint
        if self._v is not None and any(n is not None for n in self._v):
            velocity = self._store.whole(self.engine.param_layouts, self._v,
                                         f"{self.uid}-s{self._next_step()}")
        opt = (None, 0) if velocity is None else self._store.opt
        self.drop_state()
        from dask_ipar.runtime.workers import hold_replicas

        self._amm_held = hold_replicas(client)
        self.client, self.binding = client, binding
        self._store = BlockStore.of_model(self, client, binding, opt)
        self._init_params, self._init_velocity = params, velocity
        if self.input_dim is not None:
            self._build()
        return self

    def _build(self):
        check_dense_grid(self.dense_layers, self._first_dense, self.binding.grid, self.sizes)
        self.engine = self._make_engine(self.binding)
        if self._init_params is None:
            self._init_params = initial_params(self, self.engine)
        elif self._w is None:  # given before distribute (a loaded model file): check them
            self._init_params = check_params(self.engine, self._init_params)
        self._scatter_weights(self._init_params, self._init_velocity)
        self._init_params = self._init_velocity = None

    def _make_engine(self, binding) -> Engine:
        """The graph builder of this network on ``binding`` (any addresses: graphs only)."""
        grid = binding.grid
        layouts = [LayerLayout.build(k, self.sizes[k], lay, grid.pr, grid.pc)
                   for k, lay in enumerate(self.dense_layers, start=self._first_dense)]
        front = None
        if self._n_front:
            flayouts = front_layouts(self.layers[:self._n_front], self.input_shape, grid.pr,
                                     grid.pc)
            front = Front(binding, flayouts, f"flatten{self._n_front}", self.uid)
        return Engine(binding, layouts, self.uid, front=front)

    def _require(self, n_features=None):
        self._require_bound()
        if self.engine is None:
            if self.input_dim is None:
                if n_features is None:
                    raise IparError("input_dim is unknown: pass input_dim= or fit on data first.")
                self.input_dim = n_features
            self._build()

    def _as_inputs(self, X, scaled=True):
        """Checked inputs: ``(n, features)``, or ``(n, C, H, W)`` images for a CNN,
        standardized by :attr:`scaling` (unless ``scaled=False``)."""
        return as_inputs(X, self.input_dim, self.input_shape if self._n_front else None,
                         self.dtype, self.scaling if scaled else None)

    def _next_step(self) -> int:
        self._step += 1
        return self._step

    def _scatter_weights(self, params, velocity=None):
        """Place weight block (i, j) of every layer on cell (i, j); momentum afresh, or
        from ``velocity`` (whole matrices per layer, or None)."""
        step = self._next_step()
        lays = self.engine.param_layouts
        self._store.scatter(lays, params, self.dtype,
                            [self.engine.name(lay.name, "w", step) for lay in lays], step,
                            velocity, [self.engine.name(lay.name, "v", step) for lay in lays])

    def _place_batch(self, Xb, yb, step: int, g: StepGraph, pending=None):
        """Sample block j of a batch on every cell of grid column j
        (:func:`dask_ipar.runtime.placement.place_batch`)."""
        return place_batch(self.engine, self.client, Xb, yb, step, g, uid=self.uid,
                           embed_bytes=self.embed_bytes, block_module=self.block_module,
                           pending=pending)

    def _fetch(self, keys, futures) -> list:
        """Results of ``futures`` (keys ``(name, i, j, ...)``) as NumPy arrays."""
        name = f"{self.uid}-s{self._next_step()}" if self.block_module else ""
        return self._store.fetch(keys, futures, name)

    def _submit(self, graph, name, keys, step=None, first=(), leave=(), ahead=None):
        """Submit ``graph`` with the model's executor (:meth:`GraphExecutor.submit`); a
        training step (``step``) may run as worker programs, reading the blocks held in them
        (``ahead``: :meth:`dask_ipar.runtime.executors.ProgramExecutor.submit`)."""
        ex = self._executor
        if step is not None and (ex is None or ex.name != self.executor or
                                 ex.client is not self.client):
            new = make_executor(self.executor, self.client, self.uid, self._locate,
                                self.program_timeout_s)
            if ex is not None:  # sending programs still in flight
                new._orphans = ex._orphans
            self._executor = ex = new
            if new.name == "programs":
                self._programs_on = self.client  # its workers have the exchange plugin
        elif ex is None or ex.client is not self.client:
            self._executor = ex = GraphExecutor(self.client, self.uid, self._locate)
        ex.program_timeout_s = self.program_timeout_s
        if step is None or not ex.leaves_in_programs:
            self._store.materialize()  # other graphs read the blocks' own tasks
        return ex.submit(graph, name, keys, step, first, self._store.held_key, leave,
                         ahead=ahead, sent=self._store.sent_to)

    def abort_programs(self, reason: str) -> None:
        """Make this model's worker programs that are waiting for blocks fail now with
        ``reason`` (called when a grid worker has left; nothing when none ever ran)."""
        if self._store is not None:
            self._store.forget_sent()  # the mailboxes drop the blocks pushed ahead
        if self._programs_on is not None:
            abort_programs(self._programs_on, self.uid, reason, upto=(self._step, self._cuts))

    def _locate(self, key):
        """The worker of an existing block ``(name, i, j, ...)``: that of cell (i, j)."""
        return self._store.locate(key)

    # ------------------------------------------------------------ training
    def _min_samples(self) -> int:
        return min_samples(self.engine, self.binding.grid)

    def _check_batch(self, batch_size, n):
        return check_batch(self.engine, self.binding.grid, batch_size, n)

    def train_step(self, Xb, yb, optimizer: SGD, *, more: bool = False):
        """Submit one SGD step on a prepared batch; returns the loss-statistics futures.
        ``more=True``: another step follows, its weights go ahead to their readers
        (:func:`dask_ipar.runtime.steps.submit_steps`; not on a loop's last step)."""
        return submit_step(self, Xb, yb, optimizer, more=more)

    def fit(self, X, y, *, epochs: int = 1, batch_size: int = 32, optimizer: SGD | None = None,
            shuffle: bool = True, seed: int | None = None, progress=False, max_inflight: int = 2,
            measure: bool = True, machine=None, validation_data=None, standardize: bool = False,
            callbacks=(), checkpoint=None, log_file=None, diverge_factor: float = 2.0,
            shuffle_window: int | None = None, replicas=None, steps_per_program: int | str = 1
            ) -> History:
        """Train on minibatches; returns a :class:`History` of per-epoch records.

        Runs :class:`dask_ipar.runtime.loop.TrainLoop`, the loop of every training run:
        step ``s`` trains on :class:`~dask_ipar.runtime.loop.BatchPlan`'s batch ``s`` (a
        pure function of the seed and ``s``), so the same seed gives the same weights
        with or without checkpoints, and a resumed run those of an uninterrupted one.

        Parameters
        ----------
        X, y : inputs ``(n, features)`` or ``(n, C, H, W)`` images, integer labels ``(n,)``;
            NumPy, or read by the workers themselves (dask arrays, Zarr, HDF5, memmaps)
        epochs, batch_size : ``n // batch_size`` steps per epoch (the last takes the rest)
        optimizer : SGD, Adam or AdamW, with its schedule and clipping (:mod:`dask_ipar.optim`)
        shuffle, seed : each epoch's sample order (``seed`` defaults to the model's)
        shuffle_window : data read from storage shuffles within windows of this many
            chunks (default 8; 0: full shuffle; :class:`~dask_ipar.runtime.loop.BatchPlan`)
        progress : True for a tqdm bar on stderr, or a callable given each :class:`StepStats`
        max_inflight : submissions ahead of the one waited for
        steps_per_program : steps per submission, 1-16 or "auto" (by ``machine`` too:
            :func:`dask_ipar.runtime.steps.auto_steps_per_program`), losses in bursts
        measure : put the per-layer, per-phase predicted-vs-measured bytes in ``history.comm``
            (predicted seconds from ``machine``, a :class:`dask_ipar.cost.Machine`).
        validation_data : ``(X_val, y_val)``: ``val_loss``, ``val_accuracy`` per epoch
        standardize : bool
            Fit a per-feature (per-channel for images) :attr:`scaling` on ``X`` unless
            the model has one; every later input goes through it, and it is saved.
        callbacks : :class:`dask_ipar.runtime.loop.Callback` list (e.g. ``EarlyStopping``)
        checkpoint : :class:`dask_ipar.io.checkpoint.Checkpointing`: saves, resume, recovery
        replicas : every this many steps (or a :class:`~dask_ipar.runtime.replicas.Replicas`)
            copy each cell's state to a buddy worker, to rebuild a lost one from; 0: off
        log_file : a metrics log, a row per epoch (CSV for ``.csv``, else JSON lines)
        diverge_factor : when a loss counts as divergence (:class:`~dask_ipar.runtime.loop.
            TrainLoop`; 0: only a non-finite one)
        """
        return _fit(self, X, y, epochs=epochs, batch_size=batch_size, optimizer=optimizer,
                    shuffle=shuffle, seed=seed, progress=progress, max_inflight=max_inflight,
                    measure=measure, machine=machine, validation_data=validation_data,
                    standardize=standardize, callbacks=callbacks, checkpoint=checkpoint,
                    log_file=log_file, diverge_factor=diverge_factor, shuffle_window=shuffle_window,
                    replicas=replicas, steps_per_program=steps_per_program)

    def _require_bound(self):
        """Raise a clear error unless the model is on a cluster with its state intact."""
        if self._closed:
            raise IparError("this model was closed (model.close()): its weights and momentum were "
                            "released from the cluster and are gone. Save a checkpoint or call "
                            "get_weights() before closing; to go on, build a new model and load "
                            "a checkpoint into it.")
        if self.binding is None:
            raise IparError("the model is not on a cluster yet: call "
                            "model.distribute(client, grid) first.")
        self._store.require_intact()

    # ----------------------------------------------------------- inference
    def _batches(self, X, y, batch_size):
        return batches(self.engine, self.binding.grid, X, y, batch_size)

    def forward(self, X, batch_size: int | None = 4096) -> np.ndarray:
        """Logits ``(n_samples, classes)``, computed on the grid batch by batch."""
        return inference.forward(self, X, batch_size)

    def predict(self, X, batch_size: int | None = 4096) -> np.ndarray:
        """Predicted class of every sample."""
        return self.forward(X, batch_size).argmax(axis=1)

    def evaluate(self, X, y, batch_size: int | None = 4096) -> dict:
        """Mean cross-entropy ``loss`` and ``accuracy`` on ``(X, y)``."""
        return inference.evaluate(self, X, y, batch_size)

    def gradients(self, X, y):
        """Loss, accuracy and gradients ``[(dW, db), ...]`` of the mean loss over all of ``X``,
        computed on the grid exactly as a training step does, without the update."""
        return inference.gradients(self, X, y)

    # -------------------------------------------------------------- weights
    def _assemble(self, lay, name, blocks):
        return assemble(lay, name, blocks, self.binding.grid, weight_shape(self.engine, lay))

    def weight_arrays(self):
        """The master weights as dask arrays (``d_out x (d_in + bias)``), block (i, j) on
        cell (i, j). Computing one gathers it to the client. The next training step rewrites
        the weight blocks in place: compute (or copy) the arrays before submitting it."""
        self._require()
        return weight_arrays(self.engine, self._w, self._futures, self.dtype, self.block_module)

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

    def save(self, path) -> str:
        """Write the model (layers, weights, :attr:`scaling`; no optimizer state, no
        pickle) to one ``.npz`` file (:mod:`dask_ipar.io.modelfile`)."""
        from dask_ipar.io.modelfile import save_model

        return save_model(self, path)

    @classmethod
    def load(cls, path, **kwargs) -> "Sequential":
        """The model saved by :meth:`save`, to ``distribute`` (``kwargs``: ``device``)."""
        from dask_ipar.io.modelfile import load_model

        return load_model(cls, path, **kwargs)

    def set_weights(self, params):
        """Replace all weights (``[(W, b), ...]``, ``W`` is ``d_out x d_in``); resets momentum."""
        self._require()
        self._scatter_weights(check_params(self.engine, params))

    # ----------------------------------------------------- step-time model
    def predict_step_s(self, batch: int, machine, *, cores: int | None = None,
                       optimizer: SGD | None = None, executor: str | None = None,
                       steps_per_program: int = 1):
        """Predicted seconds of one training step on this grid, by simulating its task graph
        as ``executor`` (default: :attr:`executor`) runs it, ``steps_per_program`` a
        submission (:func:`dask_ipar.runtime.stepmodel.predict_step_s`)."""
        self._require()
        return predict_step_s(self, batch, machine, cores=cores, optimizer=optimizer or SGD(),
                              executor=executor, steps_per_program=steps_per_program)

    # ------------------------------------------------------- state blocks
    def state_blocks(self) -> dict:
        """Where the training state lives, block by block (for checkpoints): ``{"step",
        "grid", "dtype", "layers": [...]}``, each layer with its ``rows``/``wcols`` ranges
        and ``w``/``v``/``workers`` dicts keyed by cell (see
        :meth:`dask_ipar.runtime.state.BlockStore.state_blocks`). The next step rewrites
        the blocks in place: read them (weights first) before submitting it.
        """
        self._require()
        return self._store.state_blocks(self.engine.param_layouts, self._step, self.dtype)

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
        self._store.adopt(w_names, v_names, futures)

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
        if self._store is not None and self._store.holds_any() and self._programs_on is not None:
            self.abort_programs("the model was closed")
        self._programs_on = None
        if self._executor is not None:
            self._executor.clear()
        self._executor = None
        if self._store is not None:
            self._store.clear()
        self.engine = None
        if self._amm_held:
            from dask_ipar.runtime.workers import release_replicas

            self._amm_held = False
            release_replicas(self.client)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
