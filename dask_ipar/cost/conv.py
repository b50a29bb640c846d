"""Per-layer communication phases of convolution and pooling layers.

Its one job: price conv and pooling layers, the counterpart of the dense and
step totals in :mod:`dask_ipar.cost.model` (paper.md; equation numbers are the
paper's):

- conv layers as matmuls, filters over Pr (Eqs. 2, 8): :func:`conv_model_phases`;
- the batch/model crossover of a conv layer (Eq. 5): :func:`batch_model_crossover`;
- domain parallelism, height split over Pr and samples over Pc (Eqs. 7, 9):
  :func:`domain_layer_phases`, with the engine's exact halo exchanges
  (:func:`engine_halo_phases`, :func:`window_halo_phases`, :func:`halo_phases`)
  and phases from exact byte counts (:func:`exchange_phase`);
- the engine's layout changes and model-parallel convs, from plain shapes (the run's comm
  table and the planner both price them here): batch-layout samples to strips and back
  (:func:`engine_alltoall_phases`), and a conv with its filters over Pr on whole images
  (:func:`engine_model_conv_phases`).
"""

from __future__ import annotations

import math
from dataclasses import replace

from dask_ipar.cost.layers import FC, Conv2d, Pool2d
from dask_ipar.cost.machine import Machine
from dask_ipar.cost.model import (
    PhaseCost,
    _ceil_div,
    _check_convention,
    _check_grid,
    _matmul_phases,
    _phase,
    _weight_allreduce_all,
    dense_layer_phases,
    redistribute_phase,
)
from dask_ipar.layout.halo import halo_plan
from dask_ipar.layout.partition import split_bounds

__all__ = [
    "conv_model_phases",
    "batch_model_crossover",
    "domain_layer_phases",
    "engine_halo_phases",
    "window_halo_phases",
    "halo_phases",
    "exchange_phase",
    "engine_alltoall_phases",
    "engine_model_conv_phases",
]


# --------------------------------------------------------------------------- Eqs. 2, 5, 8 (conv as matmul)


def conv_model_phases(
    conv: Conv2d, pr: int, pc: int, batch: int, machine: Machine, *, first_layer: bool,
    convention: str = "engine", dx_size: str = "paper", name: str | None = None,
) -> list[PhaseCost]:
    """Eq. 8 phases of a conv layer treated as a matmul, filters split over Pr.

    d_i = out_h*out_w*out_c and |W_i| = k_h*k_w*in_c/groups*out_c (+ biases), Eq. 2.
    """
    _check_grid(pr, pc, batch)
    _check_convention(convention, dx_size)
    return _matmul_phases(conv, name or conv.name, pr, pc, batch, machine, first_layer, convention, dx_size)


def batch_model_crossover(conv: Conv2d) -> float:
    """Eq. 5: the batch size above which pure batch beats pure model for a conv layer.

    The bandwidth volumes are ``2*(P-1)/P*|W|`` (batch, Eq. 4) and
    ``3*B*(P-1)/P*d`` (model, Eq. 3); with |W| = k_h*k_w*X_C*Y_C and
    d = Y_H*Y_W*Y_C their ratio is ``2*k_h*k_w*X_C / (3*B*Y_H*Y_W)``, so batch
    is cheaper when ``B > 2*k_h*k_w*X_C / (3*Y_H*Y_W)``.  Biases are ignored
    as in the paper; X_C is taken per group (``in_c // groups``).
    """
    if not isinstance(conv, Conv2d):
        raise ValueError(f"conv: got {type(conv).__name__}; Eq. 5 applies to Conv2d layers")
    return 2 * conv.k_h * conv.k_w * (conv.in_c // conv.groups) / (3 * conv.out_h * conv.out_w)


# --------------------------------------------------------------------------- Eqs. 7, 9 (domain)


def domain_layer_phases(
    conv: Conv2d | Pool2d, pr: int, pc: int, batch: int, machine: Machine, *, convention: str = "engine",
    name: str | None = None, first_layer: bool = False,
) -> list[PhaseCost]:
    """Domain-parallel conv (or pooling) layer on a ``Pr x Pc`` grid (Eqs. 7, 9).

    Height split over Pr, samples over Pc, weights replicated on all P:

    - ``halo_fwd``: ``alpha + beta*(B/Pc)*X_W*X_C*floor(k_h/2)`` (Eq. 7/9 first
      term; the paper writes k_w, but the split is along the height).
    - ``halo_bwd``: ``alpha + beta*(B/Pc)*Y_W*Y_C*floor(k_h/2)``.
    - weight all-reduce over all P: ``2*(alpha*ceil(log P) + beta*(P-1)/P*|W_i|)``.

    That is the paper's convention. The engine convention is what the engine sends
    (:func:`engine_halo_phases`): the input rows each grid row reads from its
    neighbours, from the exact window geometry (kernel, stride, padding, uneven
    strips; an interior strip talks to up to 2 neighbours); backward returns the
    gradient of those same rows to their owners (the adjoint of the forward
    exchange, the same bytes), except in the first layer (``first_layer``), whose
    input needs no gradient; the dW reduce-scatter plus weight all-gather over all P.
    1 x 1 kernels send no halo. Pooling layers (:class:`Pool2d`) have the halos and no
    weights.
    """
    _check_grid(pr, pc, batch)
    _check_convention(convention)
    if not isinstance(conv, (Conv2d, Pool2d)):
        raise ValueError(f"conv: got {type(conv).__name__}; domain parallelism applies to Conv2d and "
                         "Pool2d layers")
    name = name or conv.name
    if convention == "engine":
        phases = engine_halo_phases(conv, pr, pc, batch, machine, name=name, first_layer=first_layer)
        if isinstance(conv, Pool2d):
            return phases
        return phases + _weight_allreduce_all(conv, name, pr * pc, machine, convention)
    if isinstance(conv, Pool2d):
        return []  # the paper charges pooling nothing
    w = machine.word_bytes
    halo = conv.halo_rows
    phases = []
    for phase, row_words in (("halo_fwd", conv.in_w * conv.in_c), ("halo_bwd", conv.out_w * conv.out_c)):
        if pr == 1 or halo == 0:
            phases.append(_phase(name, phase, pr, 0, 0, 0, machine))
            continue
        total = 2 * (pr - 1) * halo * row_words * batch * w
        nbytes = batch / pc * row_words * halo * w  # Eq. 7 with B/Pc samples (Eq. 9)
        phases.append(_phase(name, phase, pr, total, math.ceil(nbytes), 1, machine, nbytes))
    return phases + _weight_allreduce_all(conv, name, pr * pc, machine, convention)


def engine_halo_phases(
    layer: Conv2d | Pool2d, pr: int, pc: int, batch: int, machine: Machine, *, name: str | None = None,
    first_layer: bool = False,
) -> list[PhaseCost]:
    """The halo exchanges the engine makes for one domain-parallel conv or pooling layer
    spec: :func:`window_halo_phases` with the spec's window, stride and (top, bottom)
    padding (``pad_rows``, else its symmetric ``padding``)."""
    k = layer.k_h if isinstance(layer, Conv2d) else layer.k
    channels = layer.in_c if isinstance(layer, Conv2d) else layer.channels
    pad = layer.pad_rows if layer.pad_rows is not None else (layer.padding, layer.padding)
    return window_halo_phases(name or layer.name, layer.in_h, channels * layer.in_w, k, layer.stride, pad,
                              pr, pc, batch, machine, first_layer=first_layer)


def window_halo_phases(
    name: str, h_in: int, row_words: int, k: int, stride: int, pad: tuple[int, int], pr: int, pc: int,
    batch: int, machine: Machine, *, first_layer: bool = False,
) -> list[PhaseCost]:
    """The halo exchanges of a height-split window (conv or pooling) layer, exactly.

    The rows come from :func:`dask_ipar.layout.halo.halo_plan`, the geometry the engine builds
    its exchange from (``h_in`` input rows over ``pr``, window ``k``, ``stride``, ``pad``
    = (top, bottom)); ``row_words`` = ``C_in * W_in``. ``halo_fwd`` and ``halo_bwd`` move
    the same bytes; the first layer has no ``halo_bwd`` (:func:`halo_phases`). The
    planner's engine convention and the run's comm table both price halos here.
    """
    plan = halo_plan(h_in, pr, k, stride, tuple(pad))
    phases = halo_phases(name, sum(n.halo_rows for n in plan), row_words, pr, pc, batch, machine,
                         max_rows=max(n.halo_rows for n in plan))
    return phases[:1] if first_layer else phases


def exchange_phase(
    name: str, phase: str, group: int, total_bytes: int, max_bytes: int, messages: int, machine: Machine
) -> PhaseCost:
    """A phase from exact byte counts (the engine's own geometry), priced with ``machine``."""
    return _phase(name, phase, group, total_bytes, max_bytes, messages, machine)


def halo_phases(
    name: str, exchanged_rows: int, row_words: int, pr: int, pc: int, batch: int, machine: Machine, *, max_rows: int | None = None
) -> list[PhaseCost]:
    """The engine's halo exchanges of one domain-parallel conv or pooling layer, exactly.

    ``exchanged_rows`` is the number of input rows that grid rows read from a
    neighbour, summed over ``Pr`` (from the layer's exact window geometry: kernel,
    stride, padding, uneven blocks; ``dask_ipar.layout.halo.halo_rows``), ``row_words`` the
    words of one row of one sample (``C_in * W_in``). Forward (``halo_fwd``) sends
    those rows; backward (``halo_bwd``) returns their gradient to the owners: the same
    words each way, ``exchanged_rows * row_words * B``. ``max_rows``: most rows one
    grid row receives (for the seconds; default ``exchanged_rows / Pr`` rounded up).
    """
    _check_grid(pr, pc, batch)
    w = machine.word_bytes
    if pr == 1 or exchanged_rows == 0:
        return [_phase(name, p, pr, 0, 0, 0, machine) for p in ("halo_fwd", "halo_bwd")]
    mrows = _ceil_div(exchanged_rows, pr) if max_rows is None else max_rows
    total = exchanged_rows * row_words * batch * w
    mx = mrows * row_words * _ceil_div(batch, pc) * w
    neighbours = min(2, pr - 1)
    return [_phase(name, p, pr, total, mx, neighbours, machine) for p in ("halo_fwd", "halo_bwd")]


# --------------------------------------------------------------------------- the engine's layout changes


def engine_alltoall_phases(
    name: str, h_in: int, row_words: int, pr: int, pc: int, batch: int, machine: Machine
) -> list[PhaseCost]:
    """The engine's change from the batch layout to strips in front of the domain-parallel
    layer ``name``, and its adjoint, exactly: ``redistribute`` and ``dx_reduce``.

    In the batch layout cell ``(k, j)`` holds whole images of its share ``k`` of column
    ``j``'s samples (balanced over Pc, then over Pr); on strips it holds rows ``k`` of the
    ``h_in`` input rows (balanced over Pr) of all of column ``j``'s samples. Each cell
    sends every other cell of its grid column its samples' rows of that cell's strip
    (an all-to-all over Pr); backward returns the gradient of the same rows (the same
    bytes). ``row_words`` = ``C_in * W_in``.
    """
    _check_grid(pr, pc, batch)
    rows = [b - a for a, b in split_bounds(h_in, pr)]
    total, most = 0, 0
    for b0, b1 in split_bounds(batch, pc):
        for k, (s0, s1) in enumerate(split_bounds(b1 - b0, pr)):
            sent = (s1 - s0) * (h_in - rows[k]) * row_words * machine.word_bytes
            total += sent
            most = max(most, sent)
    return [exchange_phase(name, p, pr, total, most, pr - 1, machine)
            for p in ("redistribute", "dx_reduce")]


def engine_model_conv_phases(
    name: str, d_in: int, n_in: int, n_out: int, bias: bool, pr: int, pc: int, batch: int,
    machine: Machine, *, prev_name: str | None = None, prev_layout: str | None = None,
) -> list[PhaseCost]:
    """The engine's phases of a model-parallel conv: filters over Pr, whole images.

    ``d_in`` = ``C_in * H_in * W_in`` (one input image), the weight matrix ``n_out x n_in``
    (``n_out`` filters, ``n_in = C_in * k_h * k_w`` weights each, plus a bias column with
    ``bias``). ``prev_name``/``prev_layout`` name the layer in front and its layout
    (``"batch"``, ``"domain"`` or ``"model"``); both None for the network's first layer,
    whose whole images the client places and whose input needs no gradient. Phases:

    - the whole input images on every cell of each grid column, an all-gather over Pr
      (Eq. 6): ``redistribute`` of this layer from strips or sample blocks, the
      previous layer's ``fwd_gather`` from its channel blocks (a model-parallel layer's
      output stays split until its consumer gathers it);
    - ``dw_reduce`` and ``w_gather`` of the filters' weight rows over the grid row, as a
      dense layer's (Eq. 8);
    - ``dx_reduce``: the partial input gradients reduce-scattered over the grid column
      back to the input's owners (not for the first layer).
    """
    out = []
    if prev_layout is not None:
        gather = redistribute_phase(d_in, pr, pc, batch, machine, name=name)
        if prev_layout == "model":
            gather = replace(gather, layer=str(prev_name), phase="fwd_gather")
        out.append(gather)
    out.extend(p for p in dense_layer_phases(FC(n_in, n_out, bias=bias), pr, pc, batch, machine,
                                             first_layer=True, convention="engine", name=name)
               if p.phase in ("dw_reduce", "w_gather"))
    if prev_layout is not None:
        dx = redistribute_phase(d_in, pr, pc, batch, machine, name=name)
        out.append(replace(dx, phase="dx_reduce"))
    return out
