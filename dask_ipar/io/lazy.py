"""Data that stays where it lives: each grid cell's worker reads its own block of a batch.

:class:`LazyData` is a stored array (:mod:`dask_ipar.io.sources`), or a subset of its rows
(a split). The model wraps it for training as :class:`LazyInputs` (its dtype, image
shape and standardization) and :class:`LazyLabels` (the class count), which travel to
every grid cell once per run, a few hundred bytes each plus the subset's row map.
A step then asks each cell for its block with a :class:`Take`, a description of the batch
(the plan and step, or a range of samples) and of the cell's part of it (the column's
samples, a conv layer's image rows), and the cell's worker reads exactly that from
storage (:func:`read_inputs`, :func:`read_labels`): the client sends no sample.

Checks: dtype and shapes up front from metadata; NaN/inf in the features and labels
outside ``[0, classes)`` as each block is read, with an error naming the stored rows and
their chunk.

Prefetch: after a cell has read the block of training step ``s`` it reads that of step
``s + 1`` in a background thread of its worker (the plan is a pure function of the
step, so the worker knows it), while the step computes.

Shuffling: with a windowed plan (:class:`dask_ipar.runtime.loop.BatchPlan` ``window``)
the reads of an epoch visit the chunks window by window; each worker keeps the decoded
chunks of the current window (``window + 1`` chunks at most), so every chunk is read once
per epoch by each cell that needs samples of it.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from dask_ipar.errors import IparError
from dask_ipar.io.sources import Source, check_source, source_of
from dask_ipar.io.take import Cell, Take, count_read, drain_read_bytes, pool

__all__ = ["LazyData", "LazyInputs", "LazyLabels", "LazyBatch", "Take", "as_lazy",
           "is_lazy", "read_inputs", "read_labels", "drain_read_bytes", "labels_of",
           "lazy_inputs", "lazy_labels"]


class LazyData:
    """Rows of a stored array: all of them, or the subset ``rows`` (sorted or not)."""

    def __init__(self, src: Source, rows: np.ndarray | None = None):
        self.src, self.rows = src, rows

    @property
    def shape(self) -> tuple:
        n = self.src.shape[0] if self.rows is None else len(self.rows)
        return (n,) + tuple(self.src.shape[1:])

    @property
    def dtype(self):
        return self.src.dtype

    @property
    def ndim(self) -> int:
        return len(self.src.shape)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def chunk_rows(self) -> int:
        """Samples per storage chunk, about (a subset thins the chunks out)."""
        if self.rows is None:
            return self.src.chunk_rows
        return max(1, round(self.src.chunk_rows * len(self.rows) / max(1, self.src.shape[0])))

    def storage_rows(self, pos: np.ndarray) -> np.ndarray:
        return pos if self.rows is None else self.rows[pos]

    def __getitem__(self, idx) -> "LazyData":
        """A subset: a slice, integer positions or a boolean mask (lazy, no read)."""
        pos = np.arange(len(self))[idx]
        if pos.ndim != 1:
            raise IparError("lazy data sets take 1-D row selections only.")
        return LazyData(self.src, self.storage_rows(pos).astype(np.int64))

    def to_dask(self):
        """The rows as a dask array (for reductions computed on the cluster)."""
        X = self.src.to_dask()
        return X if self.rows is None else X[self.rows]

    def read_all(self) -> np.ndarray:
        """Every row, read here (small arrays only: the labels' class count)."""
        rows = np.arange(self.src.shape[0]) if self.rows is None else self.rows
        out = []
        for k in range(0, len(rows), 1 << 20):
            part = rows[k:k + (1 << 20)]
            u, inv = np.unique(part, return_inverse=True)
            out.append(self.src.read(u)[0][inv])
        return np.concatenate(out) if out else np.zeros((0,) + self.shape[1:], self.dtype)

    def __repr__(self):
        return f"LazyData({self.src.label}, shape={self.shape})"


def as_lazy(X) -> LazyData | None:
    """``X`` as :class:`LazyData` when it lives outside the client's memory (a dask
    array, a Zarr array, an HDF5 dataset, a ``.npy`` memmap), else None."""
    if isinstance(X, LazyData):
        return X
    if isinstance(X, (LazyInputs, LazyLabels)):
        return X.data
    src = source_of(X)
    return None if src is None else LazyData(src)


def is_lazy(X) -> bool:
    return isinstance(X, (LazyData, LazyInputs, LazyLabels)) or as_lazy(X) is not None


class _Lazy:
    """Common part of :class:`LazyInputs` and :class:`LazyLabels` (what a cell holds)."""

    data: LazyData
    tag: str
    #: whether a cell reads the next training step's block ahead
    prefetch: bool = True
    #: chunks of a shuffle window a cell keeps decoded (0: read exactly the rows)
    window: int = 0
    #: training steps of the run: no step at or past it is prefetched
    until: int | None = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_cell", None)
        state.pop("_placed", None)
        return state

    def _cellstate(self) -> Cell:
        cell = getattr(self, "_cell", None)
        if cell is None:
            cell = self._cell = Cell()
        return cell

    @property
    def shape(self):
        return self.data.shape

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx) -> "LazyBatch":
        if not isinstance(idx, slice) or idx.step not in (None, 1):
            raise IparError("a lazy data set is cut into batches by contiguous slices only.")
        start, stop, _ = idx.indices(len(self))
        return LazyBatch(self, Take(start=start, stop=stop), stop - start)

    def batch(self, plan, step: int) -> "LazyBatch":
        """Training step ``step``'s batch of ``plan`` (read by the cells)."""
        start, stop = plan.span(step)
        return LazyBatch(self, Take(plan=plan, step=step), stop - start)

    def placed(self, client, binding, uid: str) -> tuple:
        """``(name, futures, sent)``: per cell the future of this data set's copy on the
        cell's worker (sent once per grid binding: a few hundred bytes plus the row map of
        a subset), and the data bytes the client sent for it now (in-memory data inside
        a dask graph, persisted once)."""
        key = (id(client), tuple(binding.worker(i, j) for i, j in binding.grid.cells()))
        placed = getattr(self, "_placed", None)
        if placed is None or placed[0] != key:
            src = self.data.src
            sent = 0
            if getattr(src, "embedded", 0):  # in-memory data in a dask graph: once, spread
                sent = src.persist(client)
                self.prefetch = False
            name = f"input.src-{uid}-{self.tag}-{uuid.uuid4().hex[:6]}"
            futs = {}
            try:
                for i, j in binding.grid.cells():
                    futs.update(client.scatter({(name, i, j): self}, hash=False, direct=True,
                                               workers=[binding.worker(i, j)]))
            except (TypeError, AttributeError, ValueError) as exc:
                if "pickle" not in str(exc).lower() and "serializ" not in str(exc).lower():
                    raise
                raise IparError(
                    f"{src.label} cannot be sent to the workers: its graph holds an object "
                    f"that does not pickle ({exc}). Pass the stored array itself (a Zarr "
                    "array, an h5py dataset, da.from_zarr/da.from_array of one, unchanged) "
                    "and let the model convert it.") from None
            self._placed = (key, name, futs)
            return name, futs, sent
        return placed[1], placed[2], 0

    # ---------------------------------------------------------------- on the worker
    def _read(self, take: Take, sel: tuple):
        """The stored rows of ``take`` in the batch's order (bytes counted)."""
        pos = take.positions()
        rows = self.data.storage_rows(pos)
        if len(rows) > 1 and np.all(rows[1:] > rows[:-1]):
            u, inv = rows, None
        else:
            u, inv = np.unique(rows, return_inverse=True)
        if self.window and take.plan is not None and take.plan.window:
            block = self._from_chunks(u, sel)
        else:
            block, nbytes = self.data.src.read(u, sel)
            count_read(self.tag, nbytes)
        return (block if inv is None else block[inv]), rows

    def _from_chunks(self, u, sel):
        """Rows ``u`` assembled from whole chunks, each decoded once while its window lasts."""
        src, cell = self.data.src, self._cellstate()
        c = src.chunk_rows
        part = tuple((x.start, x.stop) for x in sel)  # slices hash from Python 3.12 only
        ids = u // c
        parts = []
        for cid in np.unique(ids):
            with cell.lock:
                cache = cell.chunks.setdefault(part, OrderedDict())
                block = cache.get(cid)
            if block is None:
                r0, r1 = int(cid) * c, min(src.shape[0], (int(cid) + 1) * c)
                block, nbytes = src.read(np.arange(r0, r1), sel)
                count_read(self.tag, nbytes)
                with cell.lock:  # a window's chunks, and the next window's first ones
                    cache[cid] = block
                    while len(cache) > self.window + 2:
                        cache.popitem(last=False)
            parts.append(block[u[ids == cid] - int(cid) * c])
        return np.concatenate(parts)

    def _load(self, take: Take):
        raise NotImplementedError

    def take(self, take: Take):
        """This cell's block of ``take``: prefetched, or read now; then the next
        training step's read starts in the background."""
        cell = self._cellstate()
        with cell.lock:
            fut = cell.pending.pop(take, None)
            for k in [k for k in cell.pending if k.step <= take.step]:
                del cell.pending[k]  # blocks of steps that will not come (a rewind)
        out = fut.result() if fut is not None else self._load(take)
        nxt = take.next() if self.prefetch else None
        if nxt is not None and (self.until is None or nxt.step < self.until):
            with cell.lock:
                if nxt not in cell.pending:
                    cell.pending[nxt] = pool().submit(self._load, nxt)
        return out


def _where(src: Source, rows: np.ndarray, k: int) -> str:
    r = int(rows[k])
    c = src.chunk_rows
    return (f"stored row {r} of {src.label} (its chunk {r // c}: rows {r // c * c}-"
            f"{min(src.shape[0], (r // c + 1) * c) - 1})")


class LazyInputs(_Lazy):
    """Model inputs read by the cells: ``(n, features)``, or ``(n, C, H, W)`` images
    (``image_shape`` when the store holds them flat), in ``dtype``, standardized by
    ``scaling``."""

    def __init__(self, data: LazyData, dtype, image_shape=None, scaling=None, tag=None,
                 flatten: bool = False):
        self.data, self.dtype = data, np.dtype(dtype)
        self.image_shape = None if image_shape is None else tuple(image_shape)
        self.scaling = scaling
        self.tag = tag or uuid.uuid4().hex[:8]
        #: stored images read as flat features (a dense network's input)
        self.flatten = flatten
        # chunks persisted on the cluster are fetched with a worker client, which only a
        # task's own thread may open: no background prefetch for them
        self.prefetch = not getattr(data.src, "persisted", False)

    @property
    def shape(self):
        n = len(self.data)
        if self.image_shape is not None:
            return (n,) + self.image_shape
        if self.flatten:
            return (n, int(np.prod(self.data.shape[1:])))
        return self.data.shape

    @property
    def ndim(self):
        return len(self.shape)

    def to_dask(self):
        """The inputs as a dask array in the model's view (images reshaped), unscaled."""
        D = self.data.to_dask().astype(self.dtype)
        if self.image_shape is not None and self.data.ndim != 4:
            D = D.reshape((D.shape[0],) + self.image_shape)
        elif self.flatten:
            D = D.reshape((D.shape[0], -1))
        return D

    def scaled(self, scaling) -> "LazyInputs":
        out = LazyInputs(self.data, self.dtype, self.image_shape, scaling, self.tag,
                         self.flatten)
        out.window, out.until = self.window, self.until
        return out

    def _load(self, take: Take):
        flat = self.image_shape is not None and self.data.ndim != 4
        sel = () if take.strip is None or flat else (slice(None), slice(*take.strip))
        block, rows = self._read(take, sel)
        block = block.astype(self.dtype, copy=False)
        bad = ~np.isfinite(block)
        if bad.any():
            k = int(np.argwhere(bad.reshape(len(block), -1).any(axis=1))[0, 0])
            raise IparError(
                f"the features contain NaN or inf at {_where(self.data.src, rows, k)}. "
                "Impute or drop those values before training.")
        if flat:
            block = block.reshape((len(block),) + self.image_shape)
            if take.strip is not None:
                block = block[:, :, take.strip[0]:take.strip[1]]
        elif self.flatten:
            block = block.reshape(len(block), -1)
        if self.scaling is not None:
            block = self.scaling.apply(block)
        block = np.ascontiguousarray(block)
        return block.T if take.transpose else block


class LazyLabels(_Lazy):
    """Integer class labels in ``[0, n_classes)`` read by the cells."""

    def __init__(self, data: LazyData, n_classes: int, tag=None):
        self.data, self.n_classes = data, int(n_classes)
        self.tag = tag or uuid.uuid4().hex[:8]
        self.prefetch = not getattr(data.src, "persisted", False)

    def _load(self, take: Take):
        y, rows = self._read(take, ())
        y = y.reshape(len(y))
        if y.dtype.kind == "f":
            bad = ~np.isfinite(y) | (y != np.round(y))
            if bad.any():
                k = int(np.flatnonzero(bad)[0])
                raise IparError(f"the labels hold a non-integer value {y[k]!r} at "
                                f"{_where(self.data.src, rows, k)}.")
        y = y.astype(np.int64)
        out = (y < 0) | (y >= self.n_classes)
        if out.any():
            k = int(np.flatnonzero(out)[0])
            raise IparError(
                f"label {y[k]} at {_where(self.data.src, rows, k)} is outside [0, "
                f"{self.n_classes}) for a last layer of {self.n_classes} units. Widen the "
                "last layer or remap the labels.")
        return y


@dataclass
class LazyBatch:
    """A batch of a lazy data set: the cells read it (``take`` names the batch)."""

    of: _Lazy
    take: Take
    n: int

    @property
    def shape(self):
        return (self.n,) + tuple(self.of.shape[1:])


def read_inputs(holder: LazyInputs, take: Take):
    """Task run on a cell's worker: its block of a batch's inputs."""
    return holder.take(take)


def read_labels(holder: LazyLabels, take: Take):
    """Task run on a cell's worker: its block of a batch's labels."""
    return holder.take(take)


def lazy_inputs(X, dtype, input_dim, input_shape) -> LazyInputs:
    """Metadata checks of lazy model inputs (nothing is read) and their wrapper."""
    data = as_lazy(X)
    check_source(data.src, "X")
    shape = data.shape
    if input_shape is None:  # images of a dense network: read flat
        if len(shape) not in (2, 3, 4):
            raise IparError(f"X must be (n_samples, n_features) or images, got shape {shape}.")
        d = int(np.prod(shape[1:]))
        if input_dim is not None and d != input_dim:
            raise IparError(
                f"X has {d} features but the model's first layer expects "
                f"{input_dim}. Build the model with input_dim={d}.")
        return LazyInputs(data, dtype, flatten=len(shape) > 2)
    input_shape = tuple(input_shape)
    if len(shape) == 4:
        if tuple(shape[1:]) != input_shape:
            raise IparError(f"images have shape {tuple(shape[1:])} (C, H, W), the model "
                            f"expects {input_shape} (input_shape).")
        return LazyInputs(data, dtype)
    if len(shape) in (2, 3) and int(np.prod(shape[1:])) == int(np.prod(input_shape)) and (
            len(shape) == 2 or tuple(shape[1:]) == input_shape[1:]):
        return LazyInputs(data, dtype, image_shape=input_shape)
    raise IparError(f"X has shape {shape}; the model takes images {input_shape} (C, H, W), "
                    "as (n, C, H, W), (n, H, W) for one channel, or flattened (n, C*H*W).")


def labels_of(y) -> np.ndarray:
    """Labels as a NumPy array, read here when they are stored (8 bytes a sample: what
    the CLI needs to count the classes)."""
    return y.read_all() if isinstance(y, LazyData) else np.asarray(
        y.data.read_all() if isinstance(y, LazyLabels) else y)


def lazy_labels(y, n_samples: int, n_classes: int) -> LazyLabels:
    """Metadata checks of lazy labels (values are checked as the cells read them)."""
    data = as_lazy(y)
    check_source(data.src, "y")
    shape = data.shape
    if not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)):
        raise IparError(f"y must be 1-D class labels, got shape {shape}.")
    if shape[0] != n_samples:
        raise IparError(f"X has {n_samples} samples but y has {shape[0]} labels.")
    return LazyLabels(data, n_classes)
