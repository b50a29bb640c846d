"""Per-layer, per-phase communication costs of dense layers, step totals and per-process memory.

Schemes (paper.md; equation numbers are the paper's):

- ``"model"``: the integrated 1.5D scheme of Eq. 8 on a ``Pr x Pc`` grid (W
  split by block rows over Pr, samples by columns over Pc).  ``Pc = 1`` is
  pure model parallelism (Eq. 3), ``Pr = 1`` pure batch (Eq. 4).  Conv layers
  are treated as matmuls with d = out_h*out_w*out_c (Eq. 2), filters over Pr.
- ``"domain"``: Eqs. 7 and 9, height split over Pr, samples over Pc, weights
  replicated and all-reduced over all P (priced in :mod:`dask_ipar.cost.conv`,
  with the conv-as-matmul phases and Eq. 5).
- ``"batch"``: pure batch over all P for that layer (Eq. 4's per-layer term).
- redistribution between layouts: Eq. 6.

Two conventions:

- ``"engine"`` (default): exactly what the dask-ipar engine sends.  Direct
  collectives (``p - 1`` messages per process per phase), balanced uneven
  blocks (``n//p`` or ``n//p + 1``), dX as a *reduce-scatter* over Pr (none
  for the first layer), dW as a reduce-scatter over Pc onto column-slice
  owners followed by an all-gather of the updated slices.
- ``"paper"``: the paper's formulas, Bruck/ring latencies ``alpha*ceil(log2 p)``,
  dX as an all-reduce for every layer sized ``d_i`` (``dx_size="paper"``, the
  paper's sums) or ``d_{i-1}`` (``dx_size="exact"``).

Every :class:`PhaseCost` carries the exact total bytes summed over all
processes, the bytes received by the busiest process, and the latency and
bandwidth seconds of that busiest process (the critical path).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from dask_ipar.cost.collectives import log2_ceil
from dask_ipar.cost.layers import FC, Conv2d, LayerSpec, Pool2d, as_layer_spec
from dask_ipar.cost.machine import Machine

__all__ = [
    "CONVENTIONS",
    "PHASE_BUCKET",
    "PhaseCost",
    "dense_layer_phases",
    "batch_layer_phases",
    "redistribute_phase",
    "grad_norm_phase",
    "network_phases",
    "layer_memory_bytes",
    "MemoryBreakdown",
]

CONVENTIONS = ("engine", "paper")

PHASE_BUCKET = {
    "fwd_gather": "model",
    "dx_reduce": "model",
    "dx_allreduce": "model",
    "redistribute": "model",
    "dw_reduce": "batch",
    "w_gather": "batch",
    "dw_allreduce": "batch",
    "halo_fwd": "domain",
    "halo_bwd": "domain",
    "grad_norm": "batch",
}
"""Which bar of the paper's figures each phase belongs to: ``batch`` (weight
gradients), ``model`` (activations of model-parallel layers and
redistribution) or ``domain`` (halos)."""


@dataclass(frozen=True)
class PhaseCost:
    """One communication phase of one layer.

    Attributes
    ----------
    layer : str
        Layer name (or index as a string).
    phase : str
        ``fwd_gather``, ``dx_reduce``, ``dx_allreduce``, ``dw_reduce``,
        ``w_gather``, ``dw_allreduce``, ``halo_fwd``, ``halo_bwd`` or
        ``redistribute``.
    group : int
        Processes per collective group (1 means nothing is sent).
    total_bytes : int
        Bytes received, summed over all processes (exact for uneven blocks).
    max_bytes_per_process : int
        Bytes received by the busiest process.
    messages : int
        Messages received by the busiest process.
    latency_s, bandwidth_s : float
        ``alpha * messages`` and beta-term seconds on the critical path.
    """

    layer: str
    phase: str
    group: int
    total_bytes: int
    max_bytes_per_process: int
    messages: int
    latency_s: float
    bandwidth_s: float

    @property
    def seconds(self) -> float:
        """``latency_s + bandwidth_s``: the alpha-beta time of this phase."""
        return self.latency_s + self.bandwidth_s

    @property
    def bucket(self) -> str:
        """``"batch"``, ``"model"`` or ``"domain"`` (see :data:`PHASE_BUCKET`)."""
        return PHASE_BUCKET[self.phase]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["seconds"] = self.seconds
        return d


# --------------------------------------------------------------------------- helpers


def _check_grid(pr, pc, batch) -> None:
    for name, v in (("pr", pr), ("pc", pc), ("batch", batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: got {v!r}; expected a positive integer")


def _check_convention(convention: str, dx_size: str = "paper") -> None:
    if convention not in CONVENTIONS:
        raise ValueError(f"convention: got {convention!r}; expected one of {CONVENTIONS} (default 'engine')")
    if dx_size not in ("paper", "exact"):
        raise ValueError(f"dx_size: got {dx_size!r}; expected 'paper' (d_i, the paper's sums) or 'exact' (d_(i-1))")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _phase(layer, phase, group, total_bytes, max_bytes, messages, machine, bandwidth_bytes=None) -> PhaseCost:
    """Build a phase; ``bandwidth_bytes`` (float) overrides the bytes charged to beta."""
    charged = max_bytes if bandwidth_bytes is None else bandwidth_bytes
    return PhaseCost(
        layer=str(layer),
        phase=phase,
        group=group,
        total_bytes=int(total_bytes),
        max_bytes_per_process=int(max_bytes),
        messages=int(messages),
        latency_s=machine.alpha_s * messages,
        bandwidth_s=charged / machine.bandwidth_Bps,
    )


def _paper_collective(layer, phase, p, per_process_words, total_words, machine, repeats=1) -> PhaseCost:
    """``repeats * (alpha*ceil(log2 p) + beta*(p-1)/p*n)`` (paper.md, Notation)."""
    if p == 1:
        return _phase(layer, phase, 1, 0, 0, 0, machine)
    w = machine.word_bytes
    nbytes = repeats * (p - 1) / p * per_process_words * w
    return _phase(
        layer, phase, p, repeats * total_words * w, math.ceil(nbytes - 1e-9), repeats * log2_ceil(p), machine, nbytes
    )


# --------------------------------------------------------------------------- Eq. 8 (model)


def _matmul_phases(layer, name, pr, pc, batch, machine, first_layer, convention, dx_size,
                   gather_output=True) -> list[PhaseCost]:
    """Eq. 8 phases of one layer viewed as a matmul (FC, or conv with filters over Pr)."""
    w = machine.word_bytes
    m, n = layer.d_out, layer.d_in
    n_w = layer.n_params
    bmax = _ceil_div(batch, pc)
    if convention == "paper":
        # Eq. 8: 3*(alpha*ceil(log Pr) + beta*B*(Pr-1)/Pr*d_i/Pc) + 2*(alpha*ceil(log Pc) + beta*(Pc-1)/Pc*|W_i|/Pr)
        dx = m if dx_size == "paper" else n
        return [
            _paper_collective(name, "fwd_gather", pr, batch * m / pc, (pr - 1) * m * batch, machine),
            _paper_collective(name, "dx_allreduce", pr, batch * dx / pc, (pr - 1) * dx * batch, machine, repeats=2),
            _paper_collective(name, "dw_allreduce", pc, n_w / pr, (pc - 1) * n_w, machine, repeats=2),
        ]
    out_rows, out_row_size = layer.out_rows
    in_rows, in_row_size = layer.in_rows
    w_rows, w_cols = layer.weight_rows, layer.weight_cols
    phases = []
    # Forward all-gather of Y over Pr (each column): process (i, j) receives (m - m_i) * b_j words.
    if pr > 1 and gather_output:
        mx = (out_rows - out_rows // pr) * out_row_size * bmax
        phases.append(_phase(name, "fwd_gather", pr, (pr - 1) * m * batch * w, mx * w, pr - 1, machine))
    else:
        phases.append(_phase(name, "fwd_gather", 1, 0, 0, 0, machine))
    # Backward dX reduce-scatter over Pr: process (i, j) receives (Pr-1) * n_i * b_j words.
    if not first_layer:
        if pr > 1:
            mx = (pr - 1) * _ceil_div(in_rows, pr) * in_row_size * bmax
            phases.append(_phase(name, "dx_reduce", pr, (pr - 1) * n * batch * w, mx * w, pr - 1, machine))
        else:
            phases.append(_phase(name, "dx_reduce", 1, 0, 0, 0, machine))
    # dW reduce-scatter over Pc of the row block (m_i x cols) onto column slices, then
    # all-gather of the updated slices: together Eq. 8's 2*(Pc-1)/Pc*|W|/Pr.
    if pc > 1:
        rmax = _ceil_div(w_rows, pr)
        mx_rs = (pc - 1) * rmax * _ceil_div(w_cols, pc)
        mx_ag = rmax * (w_cols - w_cols // pc)
        phases.append(_phase(name, "dw_reduce", pc, (pc - 1) * n_w * w, mx_rs * w, pc - 1, machine))
        phases.append(_phase(name, "w_gather", pc, (pc - 1) * n_w * w, mx_ag * w, pc - 1, machine))
    else:
        phases.append(_phase(name, "dw_reduce", 1, 0, 0, 0, machine))
        phases.append(_phase(name, "w_gather", 1, 0, 0, 0, machine))
    return phases


def dense_layer_phases(
    fc: FC,
    grid_pr: int,
    grid_pc: int,
    batch: int,
    machine: Machine,
    *,
    first_layer: bool,
    convention: str = "engine",
    dx_size: str = "paper",
    name: str | None = None,
    gather_output: bool = True,
) -> list[PhaseCost]:
    """Communication phases of one dense layer on a ``Pr x Pc`` grid (Eq. 8).

    The engine builds these phases in :class:`dask_ipar.nn.dense.Engine` (``_forward``:
    w_gather and fwd_gather; ``_backward``: dx_reduce and dw_reduce), each from one
    collective of :mod:`dask_ipar.nn.collectives`; the grid is
    :class:`dask_ipar.layout.grid.Grid`.

    Engine convention (n = d_in, m = d_out, |W| = m*(n+1) with bias, w bytes
    per word; totals summed over all processes):

    - ``fwd_gather``: all-gather of Y over Pr, total ``(Pr-1)*m*B*w``.
    - ``dx_reduce``: reduce-scatter of dX over Pr, total ``(Pr-1)*n*B*w``
      (absent for the first layer).
    - ``dw_reduce``: reduce-scatter of dW over Pc, total ``(Pc-1)*|W|*w``.
    - ``w_gather``: all-gather of updated weights over Pc, total ``(Pc-1)*|W|*w``.

    Latency ``alpha*(p-1)`` per phase (direct algorithm).

    Paper convention (Eq. 8, per process):
    ``fwd_gather = alpha*ceil(log Pr) + beta*B*(Pr-1)/Pr*d_i/Pc``,
    ``dx_allreduce = 2*(alpha*ceil(log Pr) + beta*B*(Pr-1)/Pr*d/Pc)`` with
    d = d_i (``dx_size="paper"``) or d_{i-1} (``"exact"``), and
    ``dw_allreduce = 2*(alpha*ceil(log Pc) + beta*(Pc-1)/Pc*|W_i|/Pr)``;
    the first layer's dX is included, as in the paper's sums.

    Parameters
    ----------
    fc : FC
        The layer (any object accepted by :func:`as_layer_spec`).
    grid_pr, grid_pc : int
        Grid shape: Pr model-parallel rows, Pc batch-parallel columns.
    batch : int
        Mini-batch size B.
    machine : Machine
    first_layer : bool
        Whether this is the network's first layer (its input needs no gradient).
    convention : {"engine", "paper"}
    dx_size : {"paper", "exact"}
        dX size in the paper convention.
    name : str, optional
        Layer label; defaults to the layer's ``name``.
    gather_output : bool
        Whether the output is all-gathered over Pr (engine convention). Not when the next
        layer is a row-parallel output layer, which reads each cell's own rows
        (:mod:`dask_ipar.cost.rowpar`): ``fwd_gather`` then moves nothing.
    """
    fc = as_layer_spec(fc)
    if not isinstance(fc, FC):
        raise ValueError(f"fc: got {type(fc).__name__}; expected an FC layer (use conv_model_phases for convolutions)")
    _check_grid(grid_pr, grid_pc, batch)
    _check_convention(convention, dx_size)
    return _matmul_phases(fc, name or fc.name, grid_pr, grid_pc, batch, machine, first_layer, convention, dx_size,
                          gather_output)


# --------------------------------------------------------------------------- Eq. 4


def _weight_allreduce_all(layer, name, procs, machine, convention) -> list[PhaseCost]:
    """All-reduce of a replicated layer's dW over all P: Eq. 4 / Eq. 7 third term,
    ``2*(alpha*ceil(log P) + beta*(P-1)/P*|W_i|)``.

    In the engine convention this is exactly the ``dw_reduce`` + ``w_gather``
    pair of Eq. 8 on a ``1 x P`` grid (column slices over all P), so a layer
    run pure batch costs the same whichever scheme names it.
    """
    n_w = layer.n_params
    if convention == "paper":
        return [_paper_collective(name, "dw_allreduce", procs, n_w, (procs - 1) * n_w, machine, repeats=2)]
    if n_w == 0:
        return []
    phases = _matmul_phases(layer, name, 1, procs, 1, machine, True, convention, "paper")
    return [p for p in phases if p.phase in ("dw_reduce", "w_gather")]


def batch_layer_phases(layer: LayerSpec, procs: int, machine: Machine, *, convention: str = "engine", name: str | None = None) -> list[PhaseCost]:
    """A layer run pure batch-parallel over all ``procs`` processes (Eq. 4 term):
    forward and dX are local; dW is all-reduced, ``2*(alpha*ceil(log P) + beta*(P-1)/P*|W_i|)``."""
    _check_grid(1, procs, 1)
    _check_convention(convention)
    layer = as_layer_spec(layer)
    return _weight_allreduce_all(layer, name or layer.name, procs, machine, convention)


def grad_norm_phase(procs: int, machine: Machine, *, name: str = "clip") -> PhaseCost:
    """The all-reduce of gradient clipping by global norm (ours; the paper has none): each
    of the P processes sums the squares of the gradient slices it owns (one word) and
    sends it to the P - 1 others, who all compute the norm. ``P (P - 1)`` words in all,
    ``P - 1`` messages of one word into each process (the engine's direct all-gather)."""
    if procs < 1:
        raise ValueError(f"procs: got {procs!r}; expected a positive integer")
    if procs == 1:
        return _phase(name, "grad_norm", 1, 0, 0, 0, machine)
    w = machine.word_bytes
    return _phase(name, "grad_norm", procs, procs * (procs - 1) * w, (procs - 1) * w,
                  procs - 1, machine)


# --------------------------------------------------------------------------- Eq. 6


def redistribute_phase(
    d: int, pr: int, pc: int, batch: int, machine: Machine, *, convention: str = "engine", name: str = "", kind: str = "allgather"
) -> PhaseCost:
    """Change of activation layout in front of a layer with input size ``d`` (Eq. 6).

    ``kind="allgather"`` (batch or domain layout -> model layout, where every
    process of a grid column needs all B/Pc samples' full activations):
    ``alpha*ceil(log Pr) + beta*B*(Pr-1)/Pr*d/Pc``; with Pc = 1 this is the
    paper's ``alpha*ceil(log P) + beta*B*(P-1)/P*d``, a third of a
    model-parallel layer (Eq. 3).  Total ``(Pr-1)*d*B*w`` bytes.

    ``kind="alltoall"`` (batch <-> domain, both holding B/P samples' worth of
    data per process): ``alpha*ceil(log Pr) + beta*(Pr-1)/Pr*d*B/P``.
    """
    _check_grid(pr, pc, batch)
    _check_convention(convention)
    w = machine.word_bytes
    if pr == 1:
        return _phase(name, "redistribute", 1, 0, 0, 0, machine)
    if kind == "allgather":
        per_words, total_words = batch * d / pc, (pr - 1) * d * batch
        bcol = _ceil_div(batch, pc)
        engine_max = d * (bcol - bcol // pr)
    elif kind == "alltoall":
        per_words, total_words = batch * d / (pc * pr), (pr - 1) * d * batch / pr
        engine_max = (pr - 1) * _ceil_div(_ceil_div(_ceil_div(batch, pc), pr) * d, pr)
    else:
        raise ValueError(f"kind: got {kind!r}; expected 'allgather' or 'alltoall'")
    if convention == "paper":
        return _paper_collective(name, "redistribute", pr, per_words, total_words, machine)
    return _phase(name, "redistribute", pr, math.ceil(total_words) * w, engine_max * w, pr - 1, machine)


# --------------------------------------------------------------------------- networks


def network_phases(
    layers, pr: int, pc: int, batch: int, machine: Machine, *, convention: str = "engine", dx_size: str = "paper"
) -> list[PhaseCost]:
    """Eq. 8 phases of every layer of a network on one grid (all layers model-parallel).

    Pooling layers send nothing.  The first layer with weights is the
    ``first_layer`` (no dX in the engine convention).  For mixed schemes
    (batch or domain conv layers) use :func:`dask_ipar.cost.planner.evaluate_grid`.
    """
    phases: list[PhaseCost] = []
    first = True
    for idx, layer in enumerate(layers):
        layer = as_layer_spec(layer)
        if isinstance(layer, Pool2d):
            continue
        name = layer.name or str(idx)
        phases += _matmul_phases(layer, name, pr, pc, batch, machine, first, convention, dx_size)
        first = False
    return phases


# --------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per process (busiest process) of one layer."""

    weights: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations

    def __add__(self, other: "MemoryBreakdown") -> "MemoryBreakdown":
        return MemoryBreakdown(
            self.weights + other.weights,
            self.gradients + other.gradients,
            self.optimizer + other.optimizer,
            self.activations + other.activations,
        )


def layer_memory_bytes(
    layer: LayerSpec, scheme: str, pr: int, pc: int, batch: int, machine: Machine, *, convention: str = "engine",
    opt_slots: int = 1,
) -> MemoryBreakdown:
    """Per-process memory of one layer (the paper gives none; this is ours).

    What is counted, in words of ``machine.word_bytes`` (ceil for uneven blocks):

    - ``"model"`` (Eq. 8 layout), engine convention: weights = |W|/P sharded
      master slice + |W|/Pr gathered row block; gradients = |W|/Pr local
      partial dW + |W|/P reduced slice; optimizer = |W|/P momentum.  Paper
      convention: |W|/Pr each for weights, gradients and momentum.
      Activations = ceil(B/Pc) * d_out (the gathered output; the input is the
      previous layer's output, counted there, or the network input, counted
      by the planner).
    - ``"domain"``: weights replicated; engine: |W| + |W|/P master, gradients
      |W| + |W|/P, momentum |W|/P; paper: |W| each.  Activations =
      ceil(B/Pc)*ceil(out_h/Pr)*out_w*out_c plus the halo rows of the input.
    - ``"batch"``: as domain for weights, activations ceil(B/P)*d_out.
    - pooling layers: activations only, in the layout of ``scheme``.

    ``opt_slots`` multiplies the optimizer state: 1 for SGD's momentum, 2 for Adam's two
    moments (each the size of the owned slice).
    """
    layer = as_layer_spec(layer)
    procs = pr * pc
    n_w = layer.n_params
    if scheme == "model":
        if convention == "engine":
            weights = _ceil_div(n_w, procs) + _ceil_div(layer.weight_rows, pr) * layer.weight_cols if n_w else 0
            grads = _ceil_div(layer.weight_rows, pr) * layer.weight_cols + _ceil_div(n_w, procs) if n_w else 0
            opt = _ceil_div(n_w, procs)
        else:
            row = _ceil_div(layer.weight_rows, pr) * layer.weight_cols if n_w else 0
            weights = grads = opt = row
        acts = _ceil_div(batch, pc) * layer.d_out
    elif scheme in ("domain", "batch"):
        if convention == "engine":
            weights = n_w + _ceil_div(n_w, procs)
            grads = n_w + _ceil_div(n_w, procs)
            opt = _ceil_div(n_w, procs)
        else:
            weights = grads = opt = n_w
        if scheme == "batch":
            acts = _ceil_div(batch, procs) * layer.d_out
        else:
            if isinstance(layer, (Conv2d, Pool2d)):
                ch = layer.out_c if isinstance(layer, Conv2d) else layer.channels
                in_ch = layer.in_c if isinstance(layer, Conv2d) else layer.channels
                halo = 2 * (layer.k_h // 2 if isinstance(layer, Conv2d) else layer.k // 2) if pr > 1 else 0
                acts = _ceil_div(batch, pc) * (
                    _ceil_div(layer.out_h, pr) * layer.out_w * ch + halo * layer.in_w * in_ch
                )
            else:
                acts = _ceil_div(batch, pc) * _ceil_div(layer.d_out, pr)
    else:
        raise ValueError(f"scheme: got {scheme!r}; expected 'model', 'domain' or 'batch'")
    w = machine.word_bytes
    return MemoryBreakdown(weights * w, grads * w, opt * opt_slots * w, acts * w)
