"""The step graph: tasks pinned to grid cells, their names, and the words each collective routes.

Every key is ``("<layer>.<task>-<uid>-s<step>", *cell)``: the dashboard groups tasks by
layer and phase (:func:`span_of_name`), and the byte meter attributes each transferred key
to the collective that moved it (:func:`phase_of_key`). The collectives
(:mod:`dask_ipar.nn.collectives`) record on the graph the words they route
(:class:`Route`), so a graph states its own communication, per layer and phase, before it
runs.
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass, field

from dask._task_spec import DataNode, Task, TaskRef
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from dask_ipar.kernels.costs import block_bytes, kernel_cost, kernel_kind, numel

__all__ = ["Route", "StepGraph", "phase_of_key", "span_of_name", "sim_tasks", "TASK_PHASE",
           "TASK_SPAN"]


#: Which collective moves the blocks of each task name between workers.
TASK_PHASE = {
    "act": "fwd_gather",
    "dxp": "dx_reduce",
    "dwp": "dw_reduce",
    "w": "w_gather",
    "dws": "w_gather",  # owned slices of an all-reduce, gathered by every cell
    "xhalo": "halo_fwd",
    "dxhalo": "halo_bwd",
    "rd": "redistribute",
    "rdx": "dx_reduce",
    "gnorm": "grad_norm",  # each cell's sum of squares, gathered by all (gradient clipping)
    "rep": "replica",  # a cell's state snapshot, fetched by its buddy (runtime/replicas.py)
}



def phase_of_key(key) -> tuple[str, str] | None:
    """``(layer, phase)`` of a transferred key, or None for keys not of a layer phase.

    >>> phase_of_key(("dense1.dwp-0a1b2c3d-s7", 0, 1, 0))
    ('dense1', 'dw_reduce')
    """
    name = key[0] if isinstance(key, tuple) else key
    if not isinstance(name, str) or "." not in name:
        return None
    layer, _, rest = name.partition(".")
    task = rest.split("-", 1)[0]
    phase = TASK_PHASE.get(task)
    return None if phase is None else (layer, phase)



#: Dashboard span (per layer) of each task name: what the task does in the step.
TASK_SPAN = {
    "wrow": "w_gather",
    "wpre": "w_gather",
    "act": "forward",
    "act_own": "forward",  # a forward task's product over its own input rows
    "xgather": "fwd_gather",
    "dxp": "dx_reduce",
    "dxs": "dx_reduce",  # the product a cell's input-gradient pieces by samples are cut from
    "dz": "backward",
    "dwp": "dw_reduce",
    "v": "update",
    "w": "update",
    "grad": "dw_reduce",
    "gsq": "grad_norm",
    "gnorm": "grad_norm",
    "gfac": "grad_norm",
    "gclip": "update",
    "rep": "replica",  # a cell's state snapshot (runtime/replicas.py)
    "repheld": "replica",  # its buddy's copy
    "stats": "loss",
    "stepstats": "loss",  # a submission's steps' statistics, one block per worker
    "x": "input",
    "y": "input",
    "fetch": "to_host",
    "cw": "w_gather",
    "logits": "forward",  # a row-parallel output layer's partials summed (nn/rowpar.py)
    "dwl": "backward",  # its partial of the whole weight gradient
    "xhalo": "halo_fwd",
    "xin": "halo_fwd",
    "inner": "forward",
    "bwd": "backward",
    "dxedge": "backward",  # a conv's edge rows' input gradient (rim first)
    "dxhalo": "halo_bwd",
    "dx": "halo_bwd",
    "dxzero": "halo_bwd",
    "rd": "redistribute",
    "rdown": "redistribute",
    "rdj": "redistribute",
    "xg": "redistribute",
    "xs": "forward",
    "dxown": "dx_reduce",
    "rdx": "dx_reduce",
    "rdxown": "dx_reduce",
    "rdxj": "dx_reduce",
}



@functools.lru_cache(maxsize=4096)
def span_of_name(name: str):
    """The ``distributed.span`` annotation of a key name: ``("dask-ipar", layer, phase)``.

    Span ids derive from the names, so every step's tasks join the same spans and the
    dashboard shows one span per layer and phase.

    >>> span_of_name("dense1.act-0a1b2c3d-s7")["name"]
    ('dask-ipar', 'dense1', 'forward')
    """
    layer, _, rest = name.partition(".")
    tags, ids = _span(layer, rest.split("-", 1)[0])
    return {"name": tags, "ids": ids}


@functools.lru_cache(maxsize=4096)
def _span(layer: str, task: str) -> tuple:
    """``(tags, ids)`` of a layer's task (three uuid5 each: cached, as every step asks)."""
    tags = ("dask-ipar", layer, TASK_SPAN.get(task, task))
    return tags, tuple(str(uuid.uuid5(uuid.NAMESPACE_URL, "/".join(tags[: k + 1])))
                       for k in range(len(tags)))



@dataclass(frozen=True)
class Route:
    """The words one collective of a layer's phase moves: ``(src cell, dst cell, words)``."""

    layer: str
    phase: str
    pairs: tuple[tuple[tuple[int, int], tuple[int, int], int], ...]

    @property
    def words(self) -> int:
        return sum(w for _, _, w in self.pairs)


@dataclass
class StepGraph:
    """A graph under construction: tasks, the worker each one is pinned to, and the words
    its collectives route."""

    dsk: dict = field(default_factory=dict)
    place: dict = field(default_factory=dict)
    #: whether the collectives record what they move (the tests do; a training step
    #: skips the bookkeeping: its bytes are the meter's)
    record_routes: bool = False
    #: what each collective added moves (:class:`Route`), in the order they were added
    routes: list = field(default_factory=list)

    def route(self, layer: str, phase: str, pairs) -> None:
        """Record that ``layer``'s ``phase`` moves ``pairs`` ``(src, dst, words)``."""
        self.routes.append(Route(layer, phase, tuple(pairs)))

    def words_of(self, words):
        """``words`` when this graph records routes, else None (nothing is counted)."""
        return words if self.record_routes else None

    def routed_words(self) -> dict:
        """Words per ``(layer, phase)`` over every route of the graph."""
        out: dict = {}
        for r in self.routes:
            out[(r.layer, r.phase)] = out.get((r.layer, r.phase), 0) + r.words
        return out

    def add(self, key, worker, func, *args):
        """Add task ``key = func(*args)`` pinned to ``worker``; dependencies are ``TaskRef``."""
        self.dsk[key] = Task(key, func, *args)
        self.place[key] = worker

    def add_data(self, key, worker, value):
        """Embed ``value`` (a small input block) as key ``key`` on ``worker``; returns its ref."""
        self.dsk[key] = DataNode(key, value)
        self.place[key] = worker
        return TaskRef(key)

    def to_hlg(self, name: str) -> HighLevelGraph:
        """One graph layer whose annotation pins every task (``allow_other_workers=False``).

        The annotations are ``dict.get`` of plain dicts, so the scheduler needs no
        dask-ipar code to evaluate them: total over the layer's keys (keys it does
        not know, none here, would get no restriction). Each task also joins the
        dashboard span of its layer and phase (:func:`span_of_name`).
        """
        spans = {k: span_of_name(k[0]) for k in self.dsk}
        layer = MaterializedLayer(
            self.dsk,
            annotations={"workers": self.place.get, "allow_other_workers": False,
                         "span": spans.get},
        )
        return HighLevelGraph({name: layer}, {name: set()})



def sim_tasks(g: StepGraph, external: dict, itemsize: int):
    """The tasks of a step graph as :class:`dask_ipar.cost.SimTask` values.

    ``external`` maps keys the graph uses but does not compute (the previous step's
    weight and momentum slices) to ``(worker, shape)``.
    """
    from dask_ipar.cost import SimTask

    shapes = {k: s for k, (_, s) in external.items()}

    def shape(arg):
        return shapes[arg.key] if isinstance(arg, TaskRef) else None

    out = []
    for key, node in g.dsk.items():  # insertion order is a topological order
        if isinstance(node, DataNode):
            shapes[key] = tuple(node.value.shape)
            continue
        oshape, flops, mem, edge = kernel_cost(node.func, node.args, shape, itemsize)
        shapes[key] = oshape
        deps = tuple(a.key for a in node.args if isinstance(a, TaskRef))
        out.append(SimTask(key, g.place[key], deps, flops, mem, numel(oshape) * itemsize,
                           block_bytes(oshape, [shapes[d] for d in deps], itemsize), edge,
                           kind=kernel_kind(node.func)))
    available = {k: (w, numel(s) * itemsize) for k, (w, s) in external.items()}
    for key, node in g.dsk.items():
        if isinstance(node, DataNode):
            available[key] = (g.place[key], node.value.nbytes)
    return out, available
