"""Stored arrays read by the workers themselves: Zarr, HDF5, ``.npy`` memmaps and dask arrays.

A :class:`Source` is a small, picklable description of an array that lives outside the
client (a path, a dataset name, a dask graph). The worker of a grid cell calls
:meth:`Source.read` with the rows it needs and gets them straight from storage; the
client never holds a sample. :func:`source_of` finds the storage under what users pass:

================================ ==========================================================
``da.from_zarr(...)``            the Zarr array itself (:class:`ZarrSource`)
``da.from_array(h5py_dataset)``  the HDF5 file and dataset (:class:`H5Source`)
a ``np.load(path, mmap_mode="r")``  the ``.npy`` file (:class:`NpySource`)
any other dask array             its graph, computed on the worker (:class:`DaskSource`;
                                 chunks persisted on other workers are fetched from them)
================================ ==========================================================

(``da.from_array`` of a memmap copies it into the client's memory in dask 2026.8: pass the
memmap itself, or what :func:`dask_ipar.io.data.load_dataset` returns.)

Each read reports the bytes it took from storage: for Zarr the bytes of the chunk objects
the store returned (measured by a counting store wrapper: compressed, whole chunks), for
the others the bytes of the selection.
"""

from __future__ import annotations

import os

import numpy as np

from dask_ipar.errors import IparError

__all__ = ["Source", "ZarrSource", "H5Source", "NpySource", "DaskSource", "source_of",
           "check_source"]


def _as_index(rows: np.ndarray):
    """A slice for a contiguous run of sorted rows (storage reads a range), else the rows."""
    if len(rows) and rows[-1] - rows[0] + 1 == len(rows):
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return rows


class Source:
    """Where a stored array is and how a worker reads rows of it."""

    shape: tuple
    dtype: np.dtype
    #: rows per storage chunk along axis 0 (what a read touches at least)
    chunk_rows: int
    #: how error messages name the array
    label: str

    def read(self, rows: np.ndarray, sel: tuple = ()) -> tuple[np.ndarray, int]:
        """``(array[rows][:, *sel], bytes read from storage)``; ``rows`` sorted, unique."""
        raise NotImplementedError

    def to_dask(self):
        """The array as a dask array (for reductions computed on the cluster): its chunks
        read through :meth:`read` wherever dask runs them (a source pickles, an open h5py
        file or a memmap would not, or would be copied whole)."""
        import dask.array as da

        return da.from_array(self, chunks=(self.chunk_rows,) + tuple(self.shape[1:]),
                             asarray=False, fancy=False, lock=False,
                             meta=np.empty((0,) * len(self.shape), self.dtype))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, key):
        """``source[rows_slice, ...]``: what :meth:`to_dask`'s chunks read."""
        key = key if isinstance(key, tuple) else (key,)
        rows = np.arange(self.shape[0])[key[0]]
        return self.read(rows, tuple(key[1:]))[0]

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_open", None)  # opened handles stay on the process that opened them
        return state


class ZarrSource(Source):
    """A Zarr array (v2 or v3 format, any store zarr can reopen by its path)."""

    def __init__(self, array):
        self._array = array
        self.shape, self.dtype = tuple(array.shape), np.dtype(array.dtype)
        self.chunk_rows = int(array.chunks[0]) if array.chunks else 1
        self.label = f"the Zarr array {_zarr_name(array)}"

    def _counted(self):
        arr = getattr(self, "_open", None)
        if arr is None:
            import zarr

            store = _counting_store(self._array.store)
            arr = zarr.open_array(store=store, path=self._array.path, mode="r")
            self._open = arr
        return arr

    def read(self, rows, sel=()):
        arr = self._counted()
        store = arr.store
        with store.lock:  # one read at a time per process: the count is this read's
            before = store.bytes_read
            data = arr.oindex[(_as_index(rows), *sel)]
            return np.asarray(data), store.bytes_read - before

    def to_dask(self):
        import dask.array as da

        return da.from_zarr(self._array)


def _zarr_name(array) -> str:
    store = getattr(array, "store", None)
    where = getattr(store, "root", None) or getattr(store, "path", None) or store or ""
    return repr(f"{where}/{array.path}" if array.path else str(where) or "<memory>")


def _counting_store(store):
    """``store`` wrapped so that the bytes of every chunk object read are counted."""
    from zarr.storage import WrapperStore

    import threading

    class CountingStore(WrapperStore):
        bytes_read = 0
        lock = threading.Lock()

        async def get(self, key, prototype, byte_range=None):
            buf = await self._store.get(key, prototype, byte_range)
            if buf is not None and not key.endswith(("zarr.json", ".zarray", ".zattrs",
                                                     ".zgroup")):
                self.bytes_read += len(buf)
            return buf

    return CountingStore(store)


class H5Source(Source):
    """A dataset of an HDF5 file, reopened read-only by each worker (h5py objects do
    not pickle)."""

    def __init__(self, filename: str, name: str, shape, dtype, chunks):
        self.filename, self.name = os.path.abspath(filename), name
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.chunk_rows = int(chunks[0]) if chunks else max(1, 2**20 // max(
            1, int(np.prod(self.shape[1:])) * self.dtype.itemsize))
        self.label = f"the HDF5 dataset {name!r} of {self.filename!r}"

    def read(self, rows, sel=()):
        ds = getattr(self, "_open", None)
        if ds is None:
            import h5py

            ds = self._open = h5py.File(self.filename, "r")[self.name]
        data = np.asarray(ds[(_as_index(rows), *sel)])
        return data, data.nbytes


class NpySource(Source):
    """A ``.npy`` file, memory-mapped by each worker."""

    def __init__(self, filename: str, shape, dtype, chunk_rows: int = 4096):
        self.filename = os.path.abspath(filename)
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.chunk_rows = int(chunk_rows)
        self.label = f"the NumPy file {self.filename!r}"

    def _map(self):
        mm = getattr(self, "_open", None)
        if mm is None:
            mm = self._open = np.load(self.filename, mmap_mode="r", allow_pickle=False)
        return mm

    def read(self, rows, sel=()):
        data = np.array(self._map()[(_as_index(rows), *sel)])
        return data, data.nbytes


class DaskSource(Source):
    """Any dask array: the worker computes the rows it needs from the array's graph
    (synchronously in the task; with a distributed client when the graph holds
    persisted chunks, which then come from the workers that hold them)."""

    def __init__(self, array):
        self.array = array
        self.shape, self.dtype = tuple(array.shape), np.dtype(array.dtype)
        self.chunk_rows = int(array.chunks[0][0]) if array.chunks[0] else 1
        self.label = f"the dask array {array.name!r}"
        self.persisted = _holds_futures(array)
        #: bytes of arrays embedded in the graph (``da.from_array`` of in-memory data)
        self.embedded = 0 if self.persisted else _embedded_bytes(array)

    def persist(self, client) -> int:
        """Put data embedded in the graph on the cluster once (its chunks spread over the
        workers, from where the cells fetch what they need) instead of sending the whole
        graph to every cell; returns the bytes sent."""
        sent, self.embedded = self.embedded, 0
        self.array = client.persist(self.array)
        self.persisted = True
        return sent

    def read(self, rows, sel=()):
        part = self.array[(_as_index(rows), *sel)]
        if self.persisted:
            from distributed import worker_client

            with worker_client() as c:
                data = np.array(c.compute(part).result())
        else:  # a copy: the graph may hand out views of arrays it holds
            data = np.array(part.compute(scheduler="sync"))
        return data, data.nbytes

    def to_dask(self):
        return self.array


def _holds_futures(array) -> bool:
    try:
        from distributed import Future
    except ImportError:  # pragma: no cover - distributed is a dependency
        return False
    for v in array.__dask_graph__().values():
        if isinstance(v, Future) or isinstance(getattr(v, "value", None), Future):
            return True
    return False


def _embedded_bytes(array) -> int:
    total = 0
    for v in array.__dask_graph__().values():
        v = getattr(v, "value", v)
        if isinstance(v, np.ndarray):
            total += v.nbytes
    return total


def _original(array):
    """The array a ``da.from_array``/``da.from_zarr`` dask array wraps, unchanged, or None."""
    graph = array.__dask_graph__()
    layers = getattr(graph, "layers", {})
    if len(layers) > 2:
        return None
    found = None
    for key, v in graph.items():
        if isinstance(key, str) and key.startswith("original-"):
            found = getattr(v, "value", v)
    if found is None:
        return None
    if tuple(getattr(found, "shape", ())) != tuple(array.shape):
        return None  # sliced or reshaped after from_array: read through the graph
    return found


def source_of(X) -> Source | None:
    """The :class:`Source` of a dask array (or a Zarr array / HDF5 dataset / memmap given
    directly), or None for in-memory data."""
    if isinstance(X, Source):
        return X
    obj = X
    if hasattr(X, "dask") and hasattr(X, "compute"):
        obj = _original(X)
        if obj is None:
            return DaskSource(X)
    kind = type(obj).__module__.split(".")[0]
    if kind == "zarr":
        return ZarrSource(obj)
    if kind == "h5py":
        return H5Source(obj.file.filename, obj.name, obj.shape, obj.dtype, obj.chunks)
    if isinstance(obj, np.memmap) and getattr(obj, "filename", None):
        try:
            mm = np.load(obj.filename, mmap_mode="r", allow_pickle=False)
        except Exception:
            mm = None
        if (mm is not None and mm.shape == obj.shape and mm.dtype == obj.dtype
                and obj.flags.c_contiguous and obj.offset == mm.offset):  # not a view
            rows = X.chunks[0][0] if hasattr(X, "chunks") else 4096
            return NpySource(obj.filename, obj.shape, obj.dtype, rows)
    if obj is not X:
        return DaskSource(X)
    return None


def check_source(src: Source, what: str):
    """Metadata checks of a stored array (nothing is read): numeric dtype."""
    if src.dtype.kind not in "biuf":
        raise IparError(
            f"{what} ({src.label}) has dtype {src.dtype}; expected numbers (object, string "
            "and structured arrays are refused).")
