"""The step-time model of every kernel: output shape, flops and memory traffic of one call.

:func:`kernel_cost` looks a task's kernel up by name in :data:`KERNEL_COSTS` and calls its
cost function with the task's arguments, array arguments replaced by their shapes; each
cost function takes the kernel's own parameters, by the kernel's names. The discrete-event
simulator of :mod:`dask_ipar.cost.simulate` turns these into step times
(:func:`dask_ipar.nn.graph.sim_tasks`).

``mem_bytes`` counts passes over the output of the allocating elementwise work (a fresh
array written is one pass, ``a += b`` three, ``a = s * b`` two). A kernel with products
also returns their edge (:func:`~dask_ipar.kernels.cost_shapes.gemm`: the elements its
products stream beyond a square product's of the same flops), which the step model prices
at the machine's ``gemm_edge_flops``; the conv front's products (short contractions,
priced with its element-wise work by the calibration's kernel mix) have none.

A kernel that returns a tuple (a conv block's backward: input gradient, weight gradient)
has a :class:`Parts` shape, one shape per item (``None`` for an item that is None); its
bytes are the sum of its items'.
"""

from __future__ import annotations

from dask_ipar.kernels.conv_costs import CONV_COSTS, CONV_KERNELS
from dask_ipar.kernels.cost_shapes import Parts, block_bytes, gemm, item as _item, numel
from dask_ipar.kernels.dense import contract_ranges, forward_segments

__all__ = ["KERNEL_COSTS", "Parts", "block_bytes", "kernel_cost", "kernel_kind", "numel"]


def _concat_rows(*blocks):
    out = (sum(s[0] for s in blocks), blocks[0][1])
    return out, 0.0, 2 * out[0] * out[1]


def _concat_cols(*blocks):
    out = (blocks[0][0], sum(s[1] for s in blocks))
    return out, 0.0, 2 * out[0] * out[1]


def _dense_forward(wb, xb, n_in, activation, *blocks):
    w, x = blocks[0], blocks[len(wb)]
    out = (w[0], x[1])
    n_cols = wb[-1][1] - wb[0][0]
    segments = forward_segments(wb, xb, n_in, w[0], x[1])
    if segments is None:  # the gathers end here: joining slices (pieces) copies them
        extra = (2 * w[0] * n_cols if len(wb) > 1 else 0) + (2 * n_in * x[1] if len(xb) > 1 else 0)
        flops, edge = gemm(w[0], n_in, x[1])
    else:  # one more product per range, added: write it, read it, read and write the sum
        extra = 4 * out[0] * out[1] * (len(segments) - 1)
        flops, edge = _products(w[0], segments, x[1])
    passes = 1 + (3 if n_cols > n_in else 0) + (2 if activation != "linear" else 0)
    return out, flops, passes * out[0] * out[1] + extra, edge


def _products(rows, ranges, cols):
    """``(flops, edge)`` of one product per contraction range, ``rows x (b - a) x cols``."""
    flops = edge = 0.0
    for a, b in ranges:
        f, e = gemm(rows, b - a, cols)
        flops, edge = flops + f, edge + e
    return flops, edge


def _dense_forward_own(wb, xb, n_in, *blocks):
    w, x = blocks[0], blocks[len(wb)]
    out = (w[0], x[1])
    ranges = contract_ranges(wb, xb, n_in)
    extra = 4 * out[0] * out[1] * (len(ranges) - 1)
    flops, edge = _products(w[0], ranges, x[1])
    return out, flops, out[0] * out[1] + extra, edge


def _dense_forward_rest(wb, xb, n_in, activation, own, *blocks):
    out, flops, mem, edge = _dense_forward_own(wb, xb, n_in, *blocks)
    # the own product added (read both, write), the bias, the activation
    passes = 3 + (3 if wb[-1][1] > n_in else 0) + (2 if activation != "linear" else 0)
    return out, flops, mem + passes * out[0] * out[1], edge


def _logits(parts):  # the logits pieces are joined first
    lg = (sum(p[0] for p in parts), parts[0][1])
    return lg, (6 + (2 if len(parts) > 1 else 0)) * lg[0] * lg[1]


def _softmax_xent_grad(labels, row_start, row_stop, batch_total, *logits):
    lg, mem = _logits(logits)
    return (row_stop - row_start, lg[1]), 0.0, mem


def _softmax_xent_stats(labels, *logits):
    return (2,), 0.0, _logits(logits)[1]


def _span(bounds, lo, hi, other):
    """Elements read and written where :func:`dask_ipar.kernels.dense.span` joins the
    slices overlapping ``lo:hi`` (``other``: the slices' length across): 0 for a view of
    one slice."""
    n = sum(1 for b0, b1 in bounds if max(lo, b0) < min(hi, b1))
    return 2 * (hi - lo) * other if n > 1 else 0


def _dx_piece(wb, c0, c1, dz, *w):
    out = (c1 - c0, dz[1])
    flops, edge = gemm(out[0], dz[0], out[1])
    return out, flops, out[0] * out[1] + _span(wb, c0, c1, dz[0]), edge


def _dz_from_pieces(a, activation, wb, c0, c1, dz, *rest):
    out = (c1 - c0, dz[1])
    passes = 1 + 3 * (len(rest) - len(wb)) + {"relu": 4, "tanh": 6}.get(activation, 0)
    flops, edge = gemm(out[0], dz[0], out[1])
    return out, flops, passes * out[0] * out[1] + _span(wb, c0, c1, dz[0]), edge


def _dz_from_own(a, activation, own, *remote):
    passes = 3 * len(remote) + {"relu": 4, "tanh": 6}.get(activation, 0)
    return own, 0.0, passes * own[0] * own[1]


def _dw_product(dz, xb, c0, c1, n_in):
    """``(flops, joined elements, edge)`` of a dW slice's product ``dZ [X; 1]^T`` over
    columns ``c0:c1``: the input's row pieces (``xb``) are joined where several hold the
    rows."""
    nw = max(0, min(c1, n_in) - c0)
    flops, edge = gemm(dz[0], dz[1], nw)
    return flops, (_span(xb, c0, c0 + nw, dz[1]) if nw else 0), edge


def _dw(dz, c0, c1, n_in, passes, xb=()):
    """A dW slice's products and passes (``xb``: see :func:`_dw_product`)."""
    out = (dz[0], c1 - c0)
    flops, joined, edge = _dw_product(dz, xb, c0, c1, n_in)
    return out, flops, passes * out[0] * out[1] + joined, edge


def _dw_piece(dz, xb, c0, c1, n_in, *x):
    return _dw(dz, c0, c1, n_in, 1 + 3 * (len(x) - len(xb)), xb)


def _sgd_velocity(w, momentum, weight_decay, n_decay, v, dz, xb, c0, c1, n_in, *rest):
    passes = 1 + 3 * (len(rest) - len(xb))
    # in-place scale-and-adds: read two, write one
    passes += (3 if weight_decay and n_decay else 0) + (3 if v is not None else 0)
    return _dw(dz, c0, c1, n_in, passes, xb)


def _sgd_weight(w, v, lr):
    return w, 0.0, 5 * w[0] * w[1]


def _sgd_update(w, v, lr, momentum, weight_decay, n_decay, in_place, n_after, dz, xb, c0, c1,
                n_in, *rest):
    """sgd_velocity in place, then the weights (in place or new)."""
    nrem = len(rest) - len(xb) - n_after
    if in_place:  # fused in place, a cache-sized slice at a time: v and w read and
        # written once from memory, the remote pieces and the decayed weights read; the
        # local dW slice and the slice of v in between stay in cache
        passes = 4 + nrem + (1 if weight_decay and n_decay else 0)
    else:
        passes = 3 + 3 * nrem + (3 if weight_decay and n_decay else 0) + 5
    flops, joined, edge = _dw_product(dz, xb, c0, c1, n_in)
    return w, flops, passes * w[0] * w[1] + joined, edge


def _adam_state(w, hp, n_decay, state, dz, xb, c0, c1, n_in, *rest):
    # dW, then the two moments (each read and written) from the gradient (read twice)
    out, flops, mem, edge = _dw(dz, c0, c1, n_in, 1 + 3 * (len(rest) - len(xb)) + 7, xb)
    return (2, *out), flops + 5.0 * out[0] * out[1], mem, edge


def _adam_weight(w, state, hp, n_decay, lr, t):
    # read both moments and the slice, a square root and a division per element, write
    return w, 4.0 * w[0] * w[1], 4 * w[0] * w[1]


def _adam_update(w, state, hp, n_decay, lr, t, in_place, n_after, dz, xb, c0, c1, n_in,
                 *rest):
    rest = rest[:len(rest) - n_after] if n_after else rest
    if in_place:  # fused in place, a cache-sized slice at a time (as _sgd_update): both
        # moments and the slice read and written once from memory, the remote pieces and
        # the decayed weights read; the local dW slice stays in cache
        nrem = len(rest) - len(xb)
        passes = 6 + nrem + (1 if hp[3] and n_decay else 0)
        flops, joined, edge = _dw_product(dz, xb, c0, c1, n_in)
        return w, flops + 9.0 * w[0] * w[1], passes * w[0] * w[1] + joined, edge
    out, flops, mem, edge = _adam_state(w, hp, n_decay, state, dz, xb, c0, c1, n_in, *rest)
    return w, flops + 4.0 * w[0] * w[1], mem + 4 * w[0] * w[1], edge


def _nesterov_update(w, v, lr, momentum, weight_decay, n_decay, dz, xb, c0, c1, n_in, *rest):
    passes = 1 + 3 * (len(rest) - len(xb)) + 3 + 3 + 3 + 5
    flops, joined, edge = _dw_product(dz, xb, c0, c1, n_in)
    return w, flops, passes * w[0] * w[1] + joined, edge


def _sum_squares(*blocks):
    n = sum(numel(b) for b in blocks)
    return (1,), 2.0 * n, n


def _clip_factor(max_norm, *sums):
    return (), float(len(sums)), 0.0


def _clip_grad(g, factor, r_off=0, c_off=0):
    return g, float(numel(g)), 2 * numel(g)


def _fetched(*blocks):
    return (), 0.0, 0.0


def _copy(x, *_):
    return x, 0.0, 2 * numel(x)


def _slice_axis(x, axis, a, b):
    x = _item(x, 0)
    out = tuple(b - a if d == axis else s for d, s in enumerate(x))
    return out, 0.0, 2 * numel(out)


def _concat_axis(axis, *blocks):
    out = tuple(sum(s[axis] for s in blocks) if d == axis else v
                for d, v in enumerate(blocks[0]))
    return out, 0.0, (2 * numel(out) if len(blocks) > 1 else 0)


def _assemble_blocks(pr, pc, *blocks):
    rows = sum(blocks[i * pc][0] for i in range(pr))
    cols = sum(b[1] for b in blocks[:pc])
    out = (rows, cols)
    # each block row joined, then the rows
    return out, 0.0, (4 * numel(out) if len(blocks) > 1 else 0)


def _identity(x):
    return x, 0.0, 0


def _first_of(pair):
    return _item(pair, 0), 0.0, 0


def _sum_pieces(own, *remote):
    return own, 0.0, 3 * len(remote) * numel(own)


def _flatten_gather(axis, *blocks):
    n = sum(b[0] for b in blocks) if axis == 0 else blocks[0][0]  # samples, rows, channels
    feats = sum(numel(b) for b in blocks) // n
    # joined (when pieces), then the transposing copy
    return (feats, n), 0.0, (2 if len(blocks) > 1 else 0) * n * feats + 2 * n * feats


def _dx_image_piece(wrow, dz, chw, axis, a, b):
    c, h, w = chw
    shape = (b - a, h, w) if axis == 1 else (c, b - a, w)
    k = numel(shape)
    out = (dz[1], *shape)
    # the columns of a row strip are gathered first (a copy); channels are a view
    cut = 2 * wrow[0] * k if axis == 2 else 0
    flops, edge = gemm(k, wrow[0], dz[1])
    return out, flops, cut + k * dz[1], edge


def _dz_image_from_pieces(wrow, dz, chw, axis, a, b, *remote):
    out, flops, mem, edge = _dx_image_piece(wrow, dz, chw, axis, a, b)
    # each remote piece added into a new array, then the contiguous copy
    return out, flops, mem + 3 * len(remote) * numel(out) + 2 * numel(out), edge


def _dx_samples(wrow, dz, chw):
    k = numel(chw)
    out = (dz[1], *chw)
    flops, edge = gemm(dz[1], wrow[0], k)
    return out, flops, numel(out), edge


def _sample_rows(images, s0, s1):
    return (s1 - s0, *images[1:]), 0.0, 0.0  # a view


def _dz_samples_from_pieces(images, s0, s1, *remote):
    out = (s1 - s0, *images[1:])
    # each remote piece added into a new array, then the contiguous copy
    return out, 0.0, 3 * len(remote) * numel(out) + 2 * numel(out)


def _grad_block(grad, r0, r1, c0, c1):
    out = (r1 - r0, c1 - c0)
    return out, 0.0, 2 * numel(out)


def _block_reduce(grad, r0, r1, c0, c1, *remote):
    out = (r1 - r0, c1 - c0)
    return out, 0.0, 2 * numel(out) + 3 * len(remote) * numel(out)


def _block_sgd_velocity(wfull, r0, r1, c0, c1, momentum, weight_decay, n_decay, v, grad,
                        *remote):
    out, _, mem = _block_reduce(grad, r0, r1, c0, c1, *remote)
    mem += (3 * out[0] * n_decay if weight_decay and n_decay else 0)
    mem += 3 * numel(out) if v is not None else 0
    return out, 0.0, mem


def _block_sgd_weight(wfull, r0, r1, c0, c1, v, lr):
    return v, 0.0, 5 * numel(v)  # v * -lr into a new array, then the slice added


def _block_nesterov_weight(wfull, r0, r1, c0, c1, v, v_old, lr, momentum):
    extra = 2 * numel(v) + (3 * numel(v) if v_old is not None else 0)
    return v, 0.0, extra + 5 * numel(v)


def _block_adam_state(wfull, r0, r1, c0, c1, hp, n_decay, state, grad, *remote):
    out, _, mem = _block_reduce(grad, r0, r1, c0, c1, *remote)
    old = 2 * 2 * numel(out) if state is not None else 0
    return (2, *out), 5.0 * numel(out), mem + old + 7 * numel(out)


def _block_adam_weight(wfull, r0, r1, c0, c1, state, hp, n_decay, lr, t):
    w = (r1 - r0, c1 - c0)
    return w, 4.0 * numel(w), 6 * numel(w)


def _partial_forward(c0, c1, wfull, x, *after):
    out = (wfull[0], x[1])
    flops, edge = gemm(wfull[0], c1 - c0, x[1])
    return out, flops, numel(out), edge


def _partial_sum(n_in, bias, activation, wfull, *partials):
    out = partials[0]
    # the copy, each partial added, the bias, the activation
    passes = 2 + 3 * (len(partials) - 1) + (3 if bias else 0) + (2 if activation != "linear" else 0)
    return out, 0.0, passes * numel(out)


def _dz_rows(a, activation, c0, c1, wfull, dz):
    out = (c1 - c0, dz[1])
    flops, edge = gemm(c1 - c0, wfull[0], dz[1])
    return out, flops, (1 + (3 if activation != "linear" else 0)) * numel(out), edge


def _grad_partial(c0, c1, n_cols, bias_sum, dz, x):
    g = (dz[0], n_cols)
    # zeros written, the product written, then copied into its columns
    flops, edge = gemm(dz[0], c1 - c0, dz[1])
    return Parts((None, g)), flops, numel(g) + 3 * dz[0] * (c1 - c0), edge


#: Cost function of each kernel, by the kernel's name; each takes the kernel's parameters
#: (array arguments as shapes) and returns ``(out_shape, flops, mem_words)``, or
#: ``(out_shape, flops, mem_words, edge)`` where it has products.
KERNEL_COSTS = {
    **CONV_COSTS,
    "concat_rows": _concat_rows,
    "concat_cols": _concat_cols,
    "dense_forward": _dense_forward,
    "dense_forward_own": _dense_forward_own,
    "dense_forward_rest": _dense_forward_rest,
    "softmax_xent_grad": _softmax_xent_grad,
    "softmax_xent_stats": _softmax_xent_stats,
    "dx_piece": _dx_piece,
    "dz_from_pieces": _dz_from_pieces,
    "dz_from_own": _dz_from_own,
    "dw_piece": _dw_piece,
    "dw_reduce": _dw_piece,  # the same products and passes as a piece
    "sgd_velocity": _sgd_velocity,
    "sgd_weight": _sgd_weight,
    "sgd_update": _sgd_update,
    "adam_state": _adam_state,
    "adam_weight": _adam_weight,
    "adam_update": _adam_update,
    "nesterov_update": _nesterov_update,
    "sum_squares": _sum_squares,
    "clip_factor": _clip_factor,
    "clip_grad": _clip_grad,
    "fetched": _fetched,
    "to_device": _copy,
    "to_host": _copy,
    "slice_axis": _slice_axis,
    "concat_axis": _concat_axis,
    "assemble_blocks": _assemble_blocks,
    "identity": _identity,
    "first_of": _first_of,
    "sum_pieces": _sum_pieces,
    "flatten_gather": _flatten_gather,
    "dx_image_piece": _dx_image_piece,
    "dz_image_from_pieces": _dz_image_from_pieces,
    "dx_samples": _dx_samples,
    "sample_rows": _sample_rows,
    "dz_samples_from_pieces": _dz_samples_from_pieces,
    "grad_block": _grad_block,
    "block_reduce": _block_reduce,
    "block_sgd_velocity": _block_sgd_velocity,
    "block_sgd_weight": _block_sgd_weight,
    "block_nesterov_weight": _block_nesterov_weight,
    "block_adam_state": _block_adam_state,
    "block_adam_weight": _block_adam_weight,
    "partial_forward": _partial_forward,
    "partial_sum": _partial_sum,
    "dz_rows": _dz_rows,
    "grad_partial": _grad_partial,
}


def kernel_cost(func, args, shape, itemsize):
    """``(out_shape, flops, mem_bytes, edge)`` of one call ``func(*args)`` (``edge``: see
    :func:`~dask_ipar.kernels.cost_shapes.gemm`; 0 for a kernel without products).

    ``shape(arg)`` gives the shape of a dependency, or None for a literal argument (passed
    to the cost function as it is).
    """
    cost = KERNEL_COSTS.get(func.__name__)
    if cost is None:
        raise ValueError(f"no cost model for kernel {func.__name__}")
    values = [a if s is None else s for a, s in ((a, shape(a)) for a in args)]
    out, flops, mem, *edge = cost(*values)
    return out, flops, mem * itemsize, (edge[0] if edge else 0.0)


def kernel_kind(func) -> str:
    """``"conv"`` for the conv front's strided kernels (conv and pooling blocks and their
    pieces, :data:`~dask_ipar.kernels.conv_costs.CONV_KERNELS`), whose element-wise work
    the step model prices at the machine's ``conv_Bps``; ``""`` for every other kernel."""
    return "conv" if getattr(func, "__name__", "") in CONV_KERNELS else ""
