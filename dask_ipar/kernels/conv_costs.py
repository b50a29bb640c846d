"""The step-time model of the conv front's kernels (NCHW blocks): conv and pooling blocks,
their backward and rim-first pieces, and the halo exchange's row pieces; each cost function
as in :mod:`dask_ipar.kernels.costs` (output shape, flops, bytes of elementwise traffic),
looked up there by the kernel's name (:data:`CONV_COSTS`)."""

from __future__ import annotations

from dask_ipar.kernels.conv import max_pool_tiles
from dask_ipar.kernels.cost_shapes import Parts, item as _item, numel

__all__ = ["CONV_COSTS", "CONV_KERNELS"]


def _conv_out(n, k, stride, lo, hi):
    return (n + lo + hi - k) // stride + 1


def _conv_geometry(x, wshape, stride, pad):
    n, c, h, w = x
    o, cg, kh, kw = wshape
    oh, ow = _conv_out(h, kh, stride, pad[0], pad[1]), _conv_out(w, kw, stride, pad[2], pad[3])
    xpad = n * c * (h + pad[0] + pad[1]) * (w + pad[2] + pad[3]) if any(pad) else 0
    cols = n * c * kh * kw * oh * ow  # im2col: one strided copy per kernel offset
    return (n, o, oh, ow), 2.0 * n * o * cg * kh * kw * oh * ow, xpad, cols


def _act_passes(activation):
    return {"relu": 2, "tanh": 2}.get(activation, 0)


def _conv_block(x, wmat, wshape, stride, pad, groups, activation):
    out, flops, xpad, cols = _conv_geometry(x, wshape, stride, pad)
    y = numel(out)
    # pad (a fresh array, then x copied in), im2col (read and write), the product, the
    # bias added into a new array, the activation in place
    bias = 2 * y if wmat[1] > wshape[1] * wshape[2] * wshape[3] else 0
    return out, flops, 2 * xpad + 2 * cols + y + bias + _act_passes(activation) * y


def _conv_rows(x, r0, r1, wmat, wshape, stride, pad, groups, activation):
    return _conv_block((x[0], x[1], r1 - r0, x[3]), wmat, wshape, stride, pad, groups,
                       activation)


def _conv_rim(x, inner, wmat, wshape, stride, pad, groups, activation, n_top, n_bottom):
    n, c, h, w = x
    kh = wshape[2]
    n_out = _conv_out(h, kh, stride, pad[0], pad[1])
    flops = mem = 0.0
    for rows in (n_top, n_bottom):  # each rim's padded input rows, its conv
        if rows:
            out, f, m = _conv_block((n, c, (rows - 1) * stride + kh, w), wmat, wshape, stride,
                                    (0, 0, pad[2], pad[3]), groups, activation)
            flops, mem = flops + f, mem + m
    out = (n, wshape[0], n_out, inner[3])
    return out, flops, mem + 2 * numel(out)  # the rims and the interior joined


def _conv_block_backward(x, wmat, a, dy, wshape, stride, pad, groups, activation, need_dx):
    out, flops, xpad, cols = _conv_geometry(x, wshape, stride, pad)
    y = numel(out)
    # dz = dy * f'(a): the derivative (a new array) and the product; im2col again; dW is
    # one (O, C*kh*kw) product per sample, summed; the bias gradient reads dz
    mem = (3 * y if activation != "linear" else 0) + 2 * xpad + 2 * cols + y
    mem += 3 * out[0] * numel(wmat)
    dx = None
    if need_dx:  # W^T dz into fresh columns, then col2im: a zeroed padded image and one
        # slice-add (read, add, write) per kernel offset
        flops *= 2
        mem += cols + max(xpad, numel(x)) + 3 * cols
        dx = tuple(x)
    return Parts((dx, tuple(wmat))), flops, mem


def _dx_strip(n, c, o, cg, kh, kw, stride, m, ow, wpad, activation):
    """Flops and bytes of the input-gradient contributions of ``m`` output rows: dz of
    those rows (the derivative and the product), ``W^T dz`` into fresh columns, col2im (a
    slice-add per kernel offset; the zeroed array it adds into is the caller's)."""
    if m <= 0:
        return 0.0, 0
    y, cols = n * o * m * ow, n * c * kh * kw * m * ow
    return (2.0 * n * o * cg * kh * kw * m * ow,
            (3 * y if activation != "linear" else 0) + cols + 3 * cols)


def _conv_dx_edges(x, wmat, a, dy, wshape, stride, pad, groups, activation, n_top,
                   n_bottom):
    n, c, _, w = x
    o, cg, kh, kw = wshape
    wpad = w + pad[2] + pad[3]
    flops = mem = 0.0
    shapes = []
    for m in (n_top, n_bottom):
        f, b = _dx_strip(n, c, o, cg, kh, kw, stride, m, dy[3], wpad, activation)
        shapes.append((n, c, (m - 1) * stride + kh if m else 0, wpad))
        flops, mem = flops + f, mem + b + numel(shapes[-1])  # into a zeroed strip
    return Parts(shapes), flops, mem


def _edge_rows(edges, side, r0, r1, base, pad):
    n, c, _, wpad = _item(edges, side)
    out = (n, c, r1 - r0, wpad - pad[2] - pad[3])
    return out, 0.0, 3 * numel(out)  # a zeroed block, the rows copied in


def _conv_block_backward_rest(x, wmat, a, dy, edges, wshape, stride, pad, groups, activation,
                              n_top, n_bottom):
    n, c, h, w = x
    o, cg, kh, kw = wshape
    # the weight gradient as the whole backward's, then the rows between the edges
    out, flops, mem = _conv_block_backward(x, wmat, a, dy, wshape, stride, pad, groups,
                                           activation, False)
    wpad = w + pad[2] + pad[3]
    # the rows between: W^T dz, col2im into a zeroed padded image (as the whole backward's)
    f, b = _dx_strip(n, c, o, cg, kh, kw, stride, dy[2] - n_top - n_bottom, dy[3], wpad,
                     "linear")
    image = numel((n, c, h + pad[0] + pad[1], wpad))
    # the two edges added (read, add, write)
    added = 3 * (numel(_item(edges, 0)) + numel(_item(edges, 1)))
    return Parts((tuple(x), out[1])), flops + f, mem + b + image + added


def _pool_geometry(x, k, stride, pad):
    n, c, h, w = x
    s = stride or k
    return (n, c, _conv_out(h, k, s, pad[0], pad[1]), _conv_out(w, k, s, pad[2], pad[3]))


def _pool_block(x, k, stride, pad, mode):
    out = _pool_geometry(x, k, stride, pad)
    y = numel(out)
    xpad = numel(x) if any(pad) else 0
    # each further window a maximum (or sum) into a new array: read two, write one
    return out, float((k * k - 1) * y), 2 * xpad + 3 * (k * k - 1) * y


def _pool_block_backward(x, dy, k, stride, pad, mode):
    out, flops, mem = _pool_block(x, k, stride, pad, mode)
    y = numel(out)
    if mode == "max" and max_pool_tiles(k, stride, (x[2] + pad[0] + pad[1],
                                                    x[3] + pad[2] + pad[3]), out[2:]):
        big = y * k * k  # the padded input's elements
        # (masks are bytes: a quarter of a float32's pass) the output repeated along its
        # window's columns (read, write k), the compare (the input, the repeats, a mask),
        # per further window offset the first-maximum updates (ten mask passes: the
        # negation 2, the and 3, the or 3, the store 2; the first offset's copy beside), the
        # finite check, the gradient repeated, the product (mask and repeats read, written)
        return tuple(x), flops + float(big), mem + (1 + k) * y + big + k * y + big / 4 \
            + 10 * (k * k - 1) * y / 4 + 1.25 * y + (1 + k) * y + big / 4 + k * y + big
    # the forward again, a zeroed input gradient, then per window: the compare, the mask
    # updates (bytes), the masked gradient and its slice-add
    return tuple(x), flops + float(k * k * y), mem + numel(x) + k * k * 12 * y


def _take_rows(x, a, b):
    out = (x[0], x[1], b - a, x[3])
    return out, 0.0, 2 * numel(out)


def _assemble(*pieces):
    out = (pieces[0][0], pieces[0][1], sum(p[2] for p in pieces), pieces[0][3])
    return out, 0.0, (2 * numel(out) if len(pieces) > 1 else 0)


def _rows_slice(grad, a, b):
    g = _item(grad, 0)
    out = (g[0], g[1], b - a, g[3])
    return out, 0.0, 2 * numel(out)


def _add_rows(own, *offsets_and_pieces):
    pieces = offsets_and_pieces[1::2]
    return own, 0.0, 3 * sum(numel(p) for p in pieces)


def _zeros_like(x):
    return x, 0.0, numel(x)


CONV_COSTS = {
    "conv_block": _conv_block,
    "conv_rows": _conv_rows,
    "conv_rim": _conv_rim,
    "conv_block_backward": _conv_block_backward,
    "conv_dx_edges": _conv_dx_edges,
    "edge_rows": _edge_rows,
    "conv_block_backward_rest": _conv_block_backward_rest,
    "pool_block": _pool_block,
    "pool_block_backward": _pool_block_backward,
    "take_rows": _take_rows,
    "assemble": _assemble,
    "rows_slice": _rows_slice,
    "add_rows": _add_rows,
    "zeros_like": _zeros_like,
}

#: The conv front's strided kernels: im2col gathers and col2im slice-adds (the conv blocks,
#: their rows, rims, edges and backward) and pooling windows. The step model prices their
#: element-wise work at the conv front's own rate (:class:`dask_ipar.cost.Machine`'s
#: ``conv_Bps``), the halo's row copies and the rest at the kernels' common one.
CONV_KERNELS = frozenset({
    "conv_block", "conv_rows", "conv_rim", "conv_block_backward", "conv_dx_edges",
    "conv_block_backward_rest", "pool_block", "pool_block_backward",
})
