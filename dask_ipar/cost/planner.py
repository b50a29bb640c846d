"""Grid planner: which Pr x Pc grid and which per-layer scheme minimise the
time per iteration (Gholami et al., SPAA 2018, Eqs. 3-9).

For every factorization ``P = Pr * Pc`` the planner prices each layer with
:mod:`dask_ipar.cost.model` and :mod:`dask_ipar.cost.conv` and adds layout changes (Eq. 6) between layers.
Conv-layer modes:

- ``"model"``: one grid for all layers; conv layers as matmuls (Eq. 8).
- ``"batch"``: conv layers pure batch over all P (needs P <= B); the grid
  applies to the FC layers only (the paper's second scenario).
- ``"domain"``: conv layers domain-parallel on the grid (Eq. 9), which keeps
  scaling past P = B with Pc <= B.
- ``"auto"``: per conv layer the cheapest of model, domain and batch, chosen
  by dynamic programming over activation layouts; the result is the cheapest
  of that and the three fixed modes, so it is never worse than any of them.

FC layers always use the grid (Eq. 8); with ``Pr = 1`` that is pure batch.

With ``schemes`` (the per-layer schemes ``dask_ipar.Sequential`` runs) in the engine
convention every layer is priced as the engine runs it (:mod:`dask_ipar.cost.engine`:
the run's comm table's formulas, byte for byte) and the grids the engine refuses are
infeasible; :func:`price_assignment` prices one given per-layer assignment that way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dask_ipar.cost.layers import FC, Conv2d, Pool2d, as_layer_spec
from dask_ipar.cost.machine import Machine
from dask_ipar.layout.partition import grid_shapes
from dask_ipar.cost.conv import domain_layer_phases
from dask_ipar.cost.engine import ENGINE_ORDER, engine_layer_phases, engine_layout, engine_refusal
from dask_ipar.cost.replica import network_state_words, replica_memory_bytes, replica_phase
from dask_ipar.cost.rowpar import dense_form, row_parallel_phases
from dask_ipar.cost.model import (
    CONVENTIONS,
    PhaseCost,
    _matmul_phases,
    batch_layer_phases,
    grad_norm_phase,
    layer_memory_bytes,
    redistribute_phase,
)

__all__ = ["MODES", "GridPlan", "PlanResult", "factorizations", "evaluate_grid", "plan", "network_flops",
           "price_assignment"]

MODES = ("batch", "model", "domain", "auto")
_LAYOUT = {"model": "rep", "batch": "batch", "domain": "domain"}
_BACKWARD_SHARE = 2.0 / 3.0  # two of the three matmuls per layer are backward


def factorizations(procs: int) -> list[tuple[int, int]]:
    """All grids ``(Pr, Pc)`` with ``Pr * Pc = procs``, by increasing Pr (not only powers of
    two); :func:`dask_ipar.layout.partition.grid_shapes`, which also orders the engine's grids."""
    return grid_shapes(procs)


def network_flops(layers, batch: int) -> int:
    """Flops of one training iteration: 3 matmuls (Y, dX, dW) of 2*macs*B each."""
    return 6 * batch * sum(as_layer_spec(layer).macs for layer in layers)


@dataclass(frozen=True)
class GridPlan:
    """Cost of one grid.  Times are per iteration (or per epoch once scaled);
    ``compute_s + batch_comm_s + model_comm_s + domain_comm_s == total_s``.
    With overlap, ``batch_comm_s`` is the part not hidden behind backward compute."""

    pr: int
    pc: int
    feasible: bool
    reason: str = ""
    compute_s: float = math.inf
    batch_comm_s: float = math.inf
    model_comm_s: float = math.inf
    domain_comm_s: float = math.inf
    total_s: float = math.inf
    mem_bytes: int = 0
    schemes: tuple[tuple[str, str], ...] = ()
    phases: tuple[PhaseCost, ...] = field(default=(), repr=False)
    #: in-memory replicas (``replicas`` refreshes): their transfer per step, amortized
    replica_comm_s: float = 0.0

    @property
    def comm_s(self) -> float:
        return self.batch_comm_s + self.model_comm_s + self.domain_comm_s + self.replica_comm_s

    def scaled(self, factor: float) -> "GridPlan":
        return GridPlan(
            self.pr, self.pc, self.feasible, self.reason, self.compute_s * factor, self.batch_comm_s * factor,
            self.model_comm_s * factor, self.domain_comm_s * factor, self.total_s * factor, self.mem_bytes,
            self.schemes, self.phases, self.replica_comm_s * factor,
        )

    def to_dict(self) -> dict:
        return {
            "pr": self.pr, "pc": self.pc, "compute_s": self.compute_s, "batch_comm_s": self.batch_comm_s,
            "model_comm_s": self.model_comm_s, "domain_comm_s": self.domain_comm_s, "total_s": self.total_s,
            "mem_bytes": self.mem_bytes, "replica_comm_s": self.replica_comm_s,
        }


@dataclass(frozen=True)
class PlanResult:
    """All grids of one planning run, the best one and the pure-batch baseline."""

    procs: int
    batch: int
    conv: str
    unit: str
    grids: tuple[GridPlan, ...]
    best: GridPlan | None
    baseline: GridPlan | None

    @property
    def feasible(self) -> list[GridPlan]:
        return [g for g in self.grids if g.feasible]

    @property
    def speedup_vs_batch(self) -> float | None:
        if self.best is None or self.baseline is None or not self.baseline.feasible:
            return None
        return self.baseline.total_s / self.best.total_s if self.best.total_s > 0 else None

    @property
    def comm_speedup_vs_batch(self) -> float | None:
        if self.best is None or self.baseline is None or not self.baseline.feasible:
            return None
        return self.baseline.comm_s / self.best.comm_s if self.best.comm_s > 0 else math.inf

    def to_dict(self) -> dict:
        best = None
        if self.best is not None:
            comm = self.comm_speedup_vs_batch
            best = {
                "pr": self.best.pr, "pc": self.best.pc, "speedup_vs_batch": self.speedup_vs_batch,
                "comm_speedup_vs_batch": None if comm is None or math.isinf(comm) else comm,
            }
        return {"unit": self.unit, "grids": [g.to_dict() for g in self.feasible], "best": best}


def _wanted(layer, mode: str, schemes=None) -> list:
    """The schemes ``mode`` lets a layer try (conv layers; others: ``[None]``)."""
    if isinstance(layer, Conv2d):
        return list((schemes or ("model", "domain", "batch")) if mode == "auto" else (mode,))
    return [None]


def _options(layer, mode: str, pr: int, pc: int, batch: int, schemes=None) -> list[str]:
    if isinstance(layer, Conv2d):
        wanted = _wanted(layer, mode, schemes)
        ok = []
        for s in wanted:
            if s == "batch" and pr * pc > batch:
                continue
            if s == "domain" and pr > min(layer.out_h, layer.in_h):
                continue
            if s == "model" and schemes is not None and (pr > layer.out_c or layer.groups > 1):
                continue  # the engine splits whole filters, ungrouped
            ok.append(s)
        return ok
    return ["model"]


def _layer_phases(layer, scheme, name, pr, pc, batch, machine, first, convention, dx_size,
                  layers=None, idx=0):
    if scheme == "model":
        if convention == "engine" and isinstance(layer, FC):
            # the network's last dense layer as the engine runs it (row-parallel where that
            # moves fewer words), and the one in front of it then without its output gather
            after = idx > 0 and layers is not None and isinstance(layers[idx - 1], FC)
            rowpar, gather = dense_form(layer, after, None if layers is None else
                                        tuple(layers[idx + 1:]), pr, pc, batch)
            if rowpar:
                return row_parallel_phases(layer, pr, pc, batch, machine, name=name)
            return _matmul_phases(layer, name, pr, pc, batch, machine, first, convention, dx_size,
                                  gather)
        return _matmul_phases(layer, name, pr, pc, batch, machine, first, convention, dx_size)
    if scheme == "domain":
        return domain_layer_phases(layer, pr, pc, batch, machine, convention=convention, name=name,
                                   first_layer=first)
    return batch_layer_phases(layer, pr * pc, machine, convention=convention, name=name)


def _transition(state, need, d, pr, pc, batch, machine, convention, name):
    """Eq. 6: cost of giving a layer with input size ``d`` its layout ``need``."""
    if state in ("input", "rep") or state == need:
        return []  # replicated data (or the input) can be sliced locally
    kind = "allgather" if need == "rep" else "alltoall"
    return [redistribute_phase(d, pr, pc, batch, machine, convention=convention, name=name, kind=kind)]


def _search(layers, allowed, pr, pc, batch, machine, convention, dx_size, domain_after_model=True):
    """Dynamic programme over layouts; returns (comm_seconds, schemes, phases, mem) or None.

    ``domain_after_model=False`` keeps the conv schemes in the engine's order: batch,
    then domain, then model (samples, then strips, then channel blocks).
    """
    rank = {"input": -1, "batch": 0, "domain": 1, "rep": 2}
    frontier = {"input": (0.0, (), ())}
    first = True
    for idx, layer in enumerate(layers):
        name = layer.name or str(idx)
        if isinstance(layer, Pool2d):  # keeps the layout; on strips the engine exchanges halos
            # (the paper's layouts: a pool with fewer output rows than Pr is not priced; the
            # engine refuses it, and so does the engine mode, _engine_search)
            if convention == "engine" and "domain" in frontier and 1 < pr <= layer.out_h:
                c, schemes, phases = frontier["domain"]
                extra = domain_layer_phases(layer, pr, pc, batch, machine, name=name, first_layer=first)
                frontier["domain"] = (c + sum(p.seconds for p in extra), schemes, phases + tuple(extra))
            first = False
            continue
        new = {}
        tname = (layer.flatten if isinstance(layer, FC) else "") or name
        for state, (cost, schemes, phases) in frontier.items():
            for s in allowed[idx]:
                need = _LAYOUT[s]
                if not domain_after_model and rank[need] < rank[state]:
                    continue
                extra = _transition(state, need, layer.d_in, pr, pc, batch, machine, convention, tname)
                extra += _layer_phases(layer, s, name, pr, pc, batch, machine, first, convention, dx_size,
                                       layers, idx)
                c = cost + sum(p.seconds for p in extra)
                if need not in new or c < new[need][0]:
                    new[need] = (c, schemes + ((name, s),), phases + tuple(extra))
        if not new:
            return None
        frontier = new
        first = False
    return min(frontier.values(), key=lambda v: v[0])


def _engine_search(layers, allowed, pr, pc, batch, machine):
    """Dynamic programme over the engine's layouts (:mod:`dask_ipar.cost.engine`): every
    layer priced as the engine runs it, the layers the engine refuses left out. Returns
    ``((comm_seconds, schemes, phases), "")``, or ``(None, why)``."""
    frontier = {"input": (0.0, (), ())}
    why = {}
    prev_name = None
    for idx, layer in enumerate(layers):
        name = layer.name or str(idx)
        new = {}
        for state, (cost, schemes, phases) in frontier.items():
            for s in allowed[idx]:
                layout = engine_layout(layer, s, state)
                reason = engine_refusal(layer, layout, state, pr, pc, batch)
                if reason:
                    why[reason] = None
                    continue
                extra = engine_layer_phases(layer, layout, state, pr, pc, batch, machine, name=name,
                                            prev_name=prev_name, first_layer=idx == 0,
                                            following=tuple(layers[idx + 1:]))
                c = cost + sum(p.seconds for p in extra)
                if layout not in new or c < new[layout][0]:
                    chosen = schemes if isinstance(layer, Pool2d) else \
                        schemes + ((name, s or "model"),)  # dense layers: the grid (Eq. 8)
                    new[layout] = (c, chosen, phases + tuple(extra))
        if not new:
            return None, "; ".join(why)
        frontier = new
        prev_name = name
    return min(frontier.values(), key=lambda v: v[0]), ""


def _memory(layers, schemes, pr, pc, batch, machine, convention, opt_slots=1) -> int:
    chosen = dict(schemes)
    w = machine.word_bytes
    first = next((as_layer_spec(x) for x in layers), None)
    total = -(-batch // pc) * first.d_in * w if first is not None else 0  # the network input
    current = "model"
    for idx, layer in enumerate(layers):
        name = layer.name or str(idx)
        scheme = chosen.get(name, current)
        current = scheme
        total += layer_memory_bytes(layer, scheme, pr, pc, batch, machine, convention=convention,
                                    opt_slots=opt_slots).total
    return total


def _finish(layers, pr, pc, batch, machine, found, overlap, convention, opt_slots=1,
            grad_clip=False, replicas=0) -> GridPlan:
    _, schemes, phases = found
    if grad_clip:  # the norm's one-word all-reduce over all P
        phases = [*phases, grad_norm_phase(pr * pc, machine)]
    buckets = {"batch": 0.0, "model": 0.0, "domain": 0.0}
    for p in phases:
        buckets[p.bucket] += p.seconds
    compute = machine.compute_s(network_flops(layers, batch), pr * pc)
    if overlap:  # perfect overlap of the weight-gradient all-reduce with backward compute
        buckets["batch"] = max(0.0, buckets["batch"] - _BACKWARD_SHARE * compute)
    mem = _memory(layers, schemes, pr, pc, batch, machine, convention, opt_slots)
    replica_s = 0.0
    if replicas and pr * pc > 1:  # each cell's state to its buddy every ``replicas`` steps
        words = network_state_words(layers, pr, pc, opt_slots)
        rep = replica_phase(words, pr, pc, machine)
        phases = [*phases, rep]
        replica_s = rep.seconds / replicas
        mem += replica_memory_bytes(words, pr, pc, machine.word_bytes)
    total = compute + buckets["batch"] + buckets["model"] + buckets["domain"] + replica_s
    return GridPlan(pr, pc, True, "", compute, buckets["batch"], buckets["model"], buckets["domain"], total, mem,
                    schemes, phases, replica_s)


def evaluate_grid(
    layers, pr: int, pc: int, batch: int, machine: Machine, *, conv: str = "auto", overlap: bool = False,
    mem_limit_bytes: float | None = None, convention: str = "engine", dx_size: str = "paper",
    schemes: tuple[str, ...] | None = None, opt_slots: int = 1, grad_clip: bool = False,
    replicas: int = 0,
) -> GridPlan:
    """Price one ``Pr x Pc`` grid for a network (Eqs. 3-9).

    Returns an infeasible :class:`GridPlan` (with ``reason``) when the grid
    cannot run the requested mode: ``Pc > B``, conv layers pure batch with
    ``P > B``, a domain split finer than the image height, or every candidate
    over ``mem_limit_bytes``. ``schemes`` restricts the per-layer choices of
    ``conv="auto"`` to the schemes ``dask_ipar.Sequential`` runs (for example
    ``("domain", "model")``), in its order (batch, then domain, then model); in the
    engine convention every layer is then priced as the engine runs it and a grid
    the engine refuses is infeasible (see :mod:`dask_ipar.cost.engine`). ``opt_slots``:
    optimizer state blocks per weight slice in the memory (1: momentum, 2: Adam);
    ``grad_clip``: gradient clipping by global norm adds its all-reduce
    (:func:`dask_ipar.cost.model.grad_norm_phase`); ``replicas``: each cell's state copied
    to a buddy every this many steps (:mod:`dask_ipar.cost.replica`: the transfer,
    amortized, in ``replica_comm_s``; two snapshots per process in the memory; 0: none).
    """
    if conv not in MODES:
        raise ValueError(f"conv: got {conv!r}; expected one of {', '.join(MODES)}")
    if convention not in CONVENTIONS:
        raise ValueError(f"convention: got {convention!r}; expected one of {', '.join(CONVENTIONS)}")
    layers = [as_layer_spec(x) for x in layers]
    if pc > batch:
        return GridPlan(pr, pc, False, f"Pc={pc} > batch {batch}: a grid column would get no samples")
    modes = ("auto", "batch", "model", "domain") if conv == "auto" else (conv,)
    if schemes is not None:
        if not schemes or set(schemes) - {"batch", "model", "domain"}:
            raise ValueError(f"schemes: got {schemes!r}; expected some of batch, model, domain")
        modes = tuple(m for m in modes if m == "auto" or m in schemes)
    engine = convention == "engine" and schemes is not None
    candidates, reasons = [], []
    for mode in modes:
        if engine:
            found, why = _engine_search(layers, [_wanted(x, mode, schemes) for x in layers], pr, pc,
                                        batch, machine)
        else:
            allowed = [_options(x, mode, pr, pc, batch, schemes) for x in layers]
            found = _search(layers, allowed, pr, pc, batch, machine, convention, dx_size,
                            domain_after_model=schemes is None)
            why = ("conv layers pure batch need P <= B" if mode == "batch" else
                   f"{mode}: Pr={pr} exceeds a conv layer's height")
        if found is None:
            reasons.append(why)
            continue
        plan_ = _finish(layers, pr, pc, batch, machine, found, overlap, convention, opt_slots,
                        grad_clip, replicas)
        if mem_limit_bytes is not None and plan_.mem_bytes > mem_limit_bytes:
            reasons.append(f"needs {plan_.mem_bytes} bytes per process > limit {int(mem_limit_bytes)}")
            continue
        candidates.append(plan_)
    if not candidates:
        return GridPlan(pr, pc, False, "; ".join(dict.fromkeys(reasons)))
    return min(candidates, key=lambda g: g.total_s)


def price_assignment(
    layers, schemes_by_layer, pr: int, pc: int, batch: int, machine: Machine, *,
    overlap: bool = False, grad_clip: bool = False,
) -> GridPlan:
    """Price one given per-layer scheme assignment as the engine runs it (engine convention).

    ``schemes_by_layer``: conv layer name -> ``"batch"``, ``"domain"`` or ``"model"``
    (a mapping, or ``(name, scheme)`` pairs such as :attr:`GridPlan.schemes`); conv layers
    it does not name are domain-parallel, the engine's default. Pooling layers keep the
    layout in front of them, dense layers use the grid. Every layer is priced with
    :func:`dask_ipar.cost.engine.engine_layer_phases`, the formulas of the run's comm
    table (``dask_ipar.runtime.meter.predict_step``), so ``.phases`` are the bytes per
    layer and phase the engine moves. Returns an infeasible :class:`GridPlan` (with
    ``reason``) for a grid the engine refuses (:func:`dask_ipar.cost.engine.engine_refusal`,
    or ``Pc > batch``). ``grad_clip`` adds clipping's norm all-reduce.
    """
    layers = [as_layer_spec(x) for x in layers]
    fixed = dict(schemes_by_layer or {})
    convs = {x.name or str(k) for k, x in enumerate(layers) if isinstance(x, Conv2d)}
    unknown = sorted(set(fixed) - convs)
    if unknown:
        raise ValueError(f"schemes_by_layer: {', '.join(map(repr, unknown))} name no conv layer; "
                         f"the conv layers are {', '.join(sorted(convs)) or 'none'}")
    bad = {k: v for k, v in fixed.items() if v not in ENGINE_ORDER}
    if bad:
        raise ValueError(f"schemes_by_layer: got {bad!r}; expected schemes among {', '.join(ENGINE_ORDER)}")
    if pc > batch:
        return GridPlan(pr, pc, False, f"Pc={pc} > batch {batch}: a grid column would get no samples")
    allowed = [[fixed.get(x.name or str(k), "domain")] if isinstance(x, Conv2d) else [None]
               for k, x in enumerate(layers)]
    found, why = _engine_search(layers, allowed, pr, pc, batch, machine)
    if found is None:
        return GridPlan(pr, pc, False, why)
    return _finish(layers, pr, pc, batch, machine, found, overlap, "engine",
                   grad_clip=grad_clip)


def plan(
    layers, procs: int, batch: int, machine: Machine, *, conv: str = "auto", overlap: bool = False,
    mem_limit_bytes: float | None = None, convention: str = "engine", samples: int | None = None,
    dx_size: str = "paper", schemes: tuple[str, ...] | None = None, opt_slots: int = 1,
    grad_clip: bool = False, replicas: int = 0,
) -> PlanResult:
    """Evaluate every factorization of ``procs`` and pick the fastest grid.

    Parameters
    ----------
    layers : sequence of layer specs (see :func:`dask_ipar.cost.get_network`)
    procs : int
        P.
    batch : int
        Mini-batch size B.
    machine : Machine
    conv : {"batch", "model", "domain", "auto"}
    overlap : bool
        Hide the weight-gradient all-reduce behind the backward compute
        (2/3 of the iteration's compute); only the excess is charged.
    mem_limit_bytes : float, optional
        Grids needing more bytes per process are excluded.
    convention : {"engine", "paper"}
    samples : int, optional
        N; when given, times are per epoch (N/B iterations).
    schemes : tuple of str, optional
        Restrict ``conv="auto"`` to these per-layer schemes (see :func:`evaluate_grid`).
    opt_slots : int
        Optimizer state per weight slice, in weight copies (SGD momentum 1, Adam 2).
    replicas : int
        Steps between refreshes of the in-memory replicas (0: none; see
        :func:`evaluate_grid`).
    """
    for nm, v in (("batch", batch), ("opt_slots", opt_slots)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{nm}: got {v!r}; expected a positive integer")
    if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 1):
        raise ValueError(f"samples: got {samples!r}; expected a positive integer number of training samples")
    if mem_limit_bytes is not None and not mem_limit_bytes > 0:
        raise ValueError(f"mem_limit_bytes: got {mem_limit_bytes!r}; expected a positive byte count")
    layers = [as_layer_spec(x) for x in layers]
    grids = [
        evaluate_grid(layers, pr, pc, batch, machine, conv=conv, overlap=overlap, mem_limit_bytes=mem_limit_bytes,
                      convention=convention, dx_size=dx_size, schemes=schemes, opt_slots=opt_slots,
                      grad_clip=grad_clip, replicas=replicas)
        for pr, pc in factorizations(procs)
    ]
    unit = "iteration"
    if samples is not None:
        unit = "epoch"
        grids = [g.scaled(samples / batch) if g.feasible else g for g in grids]
    feasible = [g for g in grids if g.feasible]
    best = min(feasible, key=lambda g: (g.total_s, g.pr)) if feasible else None
    baseline = grids[0]  # Pr = 1, Pc = P: pure batch (Eq. 4)
    return PlanResult(procs, batch, conv, unit, tuple(grids), best, baseline)
