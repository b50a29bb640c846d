"""Local convolution and pooling kernels (NCHW), forward and backward.

The per-block computations of the conv and pooling layers (and, as ``conv_block`` and
friends, a layer's whole local step with its weights held as one matrix); the distributed
graphs around them are in :mod:`dask_ipar.nn.conv` and :mod:`dask_ipar.nn.front`.
Written against the Python array API standard (strided slicing,
``reshape``, ``matmul``), so the same code runs on NumPy and CuPy: im2col is
a loop over the ``k_h * k_w`` kernel offsets, each one strided slice of the
padded input, followed by one matmul per group; col2im is the same loop with
slice-adds.

Padding is ``(top, bottom, left, right)`` so that a block of a height-split
image can be padded on its outer edges only.
"""

from __future__ import annotations

from dask_ipar.kernels import dense as K
from dask_ipar.kernels.blas import matmul
from dask_ipar.kernels.blocks import xp_of

__all__ = [
    "conv_out_size",
    "pad2d",
    "conv2d_forward",
    "conv2d_backward",
    "pool2d_forward",
    "pool2d_backward",
    "max_pool_tiles",
    "conv_block",
    "conv_rows",
    "conv_rim",
    "conv_block_backward",
    "conv_dx_edges",
    "edge_rows",
    "conv_block_backward_rest",
    "dx_rows_outputs",
    "pool_block",
    "pool_block_backward",
]


def conv_out_size(n: int, k: int, stride: int, pad_lo: int, pad_hi: int) -> int:
    """Output length of a window of ``k`` sliding by ``stride`` over ``n + pads``."""
    return (n + pad_lo + pad_hi - k) // stride + 1


def pad2d(x, pad, value=0.0):
    """Pad the last two axes of ``x`` by ``(top, bottom, left, right)``."""
    top, bottom, left, right = pad
    if not any(pad):
        return x
    xp = xp_of(x)
    n, c, h, w = x.shape
    out = xp.full((n, c, h + top + bottom, w + left + right), value, dtype=x.dtype)
    out[:, :, top:top + h, left:left + w] = x
    return out


def _windows(xpad, kh, kw, stride, oh, ow):
    """Yield ``(i, j, view)``: the strided slice of every kernel offset."""
    for i in range(kh):
        for j in range(kw):
            yield i, j, xpad[:, :, i:i + stride * (oh - 1) + 1:stride,
                             j:j + stride * (ow - 1) + 1:stride]


def _im2col(xpad, kh, kw, stride, oh, ow):
    """``(N, C * kh * kw, OH * OW)`` columns, ordered like ``w.reshape(O, -1)``."""
    xp = xp_of(xpad)
    n, c = xpad.shape[:2]
    cols = xp.stack([v for _, _, v in _windows(xpad, kh, kw, stride, oh, ow)], axis=2)
    return xp.reshape(cols, (n, c * kh * kw, oh * ow))


def conv2d_forward(x, w, b, stride=1, pad=(0, 0, 0, 0), groups=1):
    """``y = conv(x, w) + b`` for ``x (N, C, H, W)``, ``w (O, C // groups, kh, kw)``."""
    xp = xp_of(x)
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    oh = conv_out_size(h, kh, stride, pad[0], pad[1])
    ow = conv_out_size(wd, kw, stride, pad[2], pad[3])
    cols = _im2col(pad2d(x, pad), kh, kw, stride, oh, ow)  # (N, C*kh*kw, L)
    og = o // groups
    outs = []
    for gi in range(groups):
        wg = xp.reshape(w[gi * og:(gi + 1) * og, ...], (og, cg * kh * kw))
        cg_cols = cols[:, gi * cg * kh * kw:(gi + 1) * cg * kh * kw, :]
        outs.append(matmul(wg, cg_cols))  # (N, og, L) by broadcasting
    y = outs[0] if groups == 1 else xp.concat(outs, axis=1)
    y = xp.reshape(y, (n, o, oh, ow))
    if b is not None:
        y = y + xp.reshape(b, (1, o, 1, 1))
    return y


def _dx_padded(w, dz2, shape, stride, oh, ow, groups, dtype, out=None, at=0):
    """The padded input gradient ``shape`` ``(N, C, H_pad, W_pad)`` of output gradient
    ``dz2`` ``(N, O, oh * ow)``: ``W^T dz`` into columns (one product per group), then
    col2im (one slice-add per kernel offset, into zeros; into ``out`` from its row ``at``
    where given, which is returned)."""
    xp = xp_of(dz2)
    n, c = shape[:2]
    o, cg, kh, kw = w.shape
    og = o // groups
    dcols = []
    for gi in range(groups):
        wg = xp.reshape(w[gi * og:(gi + 1) * og, ...], (og, cg * kh * kw))
        dcols.append(matmul(wg.T, dz2[:, gi * og:(gi + 1) * og, :]))  # (N, cg*kh*kw, L)
    dcol = dcols[0] if groups == 1 else xp.concat(dcols, axis=1)
    dcol = xp.reshape(dcol, (n, c, kh, kw, oh, ow))
    dxpad = xp.zeros(shape, dtype=dtype) if out is None else out
    for i in range(kh):
        for j in range(kw):
            rows = slice(at + i, at + i + stride * (oh - 1) + 1, stride)
            cols_ = slice(j, j + stride * (ow - 1) + 1, stride)
            dxpad[:, :, rows, cols_] += dcol[:, :, i, j, :, :]
    return dxpad


def conv2d_backward(x, w, dy, stride=1, pad=(0, 0, 0, 0), groups=1, bias=True, need_dx=True):
    """Gradients ``(dx, dw, db)`` of :func:`conv2d_forward` for the output gradient ``dy``.

    ``need_dx=False`` skips the input gradient (a network's first layer): dx is None.
    """
    xp = xp_of(x)
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    _, _, oh, ow = dy.shape
    xpad = pad2d(x, pad)
    cols = _im2col(xpad, kh, kw, stride, oh, ow)  # (N, C*kh*kw, L)
    dy2 = xp.reshape(dy, (n, o, oh * ow))
    og = o // groups
    dws = []
    for gi in range(groups):
        dyg = dy2[:, gi * og:(gi + 1) * og, :]  # (N, og, L)
        colg = cols[:, gi * cg * kh * kw:(gi + 1) * cg * kh * kw, :]
        dws.append(xp.sum(matmul(dyg, xp.permute_dims(colg, (0, 2, 1))), axis=0))  # (og, cg*kh*kw)
    dw = xp.reshape(dws[0] if groups == 1 else xp.concat(dws, axis=0), w.shape)
    db = xp.sum(dy, axis=(0, 2, 3)) if bias else None
    if not need_dx:
        return None, dw, db
    dxpad = _dx_padded(w, dy2, xpad.shape, stride, oh, ow, groups, x.dtype)
    dx = dxpad[:, :, pad[0]:pad[0] + h, pad[2]:pad[2] + wd]
    return dx, dw, db


def pool2d_forward(x, k, stride=None, pad=(0, 0, 0, 0), mode="max"):
    """Max or average pooling over ``k x k`` windows (padding never wins a max; average
    pooling counts only the real elements of each window)."""
    xp = xp_of(x)
    stride = stride or k
    n, c, h, wd = x.shape
    oh = conv_out_size(h, k, stride, pad[0], pad[1])
    ow = conv_out_size(wd, k, stride, pad[2], pad[3])
    if mode == "max":
        xpad = pad2d(x, pad, value=-float("inf"))
        out = None
        for _, _, v in _windows(xpad, k, k, stride, oh, ow):
            out = v if out is None else xp.maximum(out, v)
        return out
    xpad = pad2d(x, pad)
    count = pad2d(xp.ones((1, 1, h, wd), dtype=x.dtype), pad)
    total = sum(v for _, _, v in _windows(xpad, k, k, stride, oh, ow))
    cnt = sum(v for _, _, v in _windows(count, k, k, stride, oh, ow))
    return total / cnt


def max_pool_tiles(k, stride, padded_hw, out_hw) -> bool:
    """Whether ``k x k`` windows at ``stride`` (None: ``k``) with ``out_hw`` outputs tile a
    padded input of ``padded_hw``: no overlap, no rows or columns left over. Max pooling's
    backward then takes :func:`_max_pool_tiled_backward` (and its cost model says so)."""
    return (stride or k) == k and tuple(padded_hw) == (out_hw[0] * k, out_hw[1] * k)


def _max_pool_tiled_backward(xpad, y, dy, k):
    """Max pooling's input gradient where the windows tile the (padded) input: ``k x k``
    windows at stride ``k`` covering it exactly (the usual 2 x 2 pooling). A window's rows
    are an axis of a reshaped view, so the gradient is written once, contiguously, by one
    broadcast product of a mask and the output gradient, instead of a zeroed array and a
    strided read-modify-write per window offset (each of which touches every cache line of
    the array); the first maximum of each window (row-major) is found on a boolean array a
    quarter of the input's bytes. The same routing, so the same values, as the general path
    (a zero may come out as -0.0)."""
    xp = xp_of(xpad)
    n, c, hp, wp = xpad.shape
    oh = hp // k
    # each output repeated along its window's columns: the compares and the select then
    # run along whole rows (a window axis of length k last would make numpy's inner loops
    # k long)
    hit = xp.reshape(xpad, (n, c, oh, k, wp)) == xp.repeat(y, k, axis=3)[:, :, :, None, :]
    taken = None
    for i in range(k):
        for j in range(k):
            v = hit[:, :, :, i, j::k]
            if taken is None:
                taken = xp.asarray(v, copy=True)
                continue
            first = v & ~taken
            taken |= v
            hit[:, :, :, i, j::k] = first
    dyr = xp.repeat(dy, k, axis=3)[:, :, :, None, :]
    m = K._ufuncs(dy)
    if m is not None and bool(xp.all(xp.isfinite(dy))):  # 5x faster than a select (NumPy)
        dx = m.multiply(hit, dyr, dtype=xpad.dtype)
    else:  # elsewhere, or where 0 * inf would make nan: the others' gradient stays 0
        dx = xp.where(hit, dyr, xp.zeros((), dtype=xpad.dtype))
    return xp.reshape(dx, (n, c, hp, wp))


def pool2d_backward(x, dy, k, stride=None, pad=(0, 0, 0, 0), mode="max", tiled=True):
    """Gradient of :func:`pool2d_forward` with respect to ``x``.

    Max pooling routes each window's gradient to its first maximum (row-major), like
    PyTorch; where the windows tile the padded input (``stride == k``, no rows or columns
    left over) by :func:`_max_pool_tiled_backward` unless ``tiled=False`` (the window-by-
    window path, for comparison).
    """
    xp = xp_of(x)
    stride = stride or k
    n, c, h, wd = x.shape
    _, _, oh, ow = dy.shape
    if mode == "max":
        xpad = pad2d(x, pad, value=-float("inf"))
        y = pool2d_forward(x, k, stride, pad, "max")
        if tiled and max_pool_tiles(k, stride, xpad.shape[2:], (oh, ow)):
            dxpad = _max_pool_tiled_backward(xpad, y, dy, k)
            return dxpad[:, :, pad[0]:pad[0] + h, pad[2]:pad[2] + wd]
        taken = xp.zeros(y.shape, dtype=xp.bool)
    else:
        xpad = pad2d(x, pad)
        count = pad2d(xp.ones((1, 1, h, wd), dtype=x.dtype), pad)
        cnt = sum(v for _, _, v in _windows(count, k, k, stride, oh, ow))
        share = dy / cnt
    dxpad = xp.zeros(xpad.shape, dtype=x.dtype)
    for i, j, v in _windows(xpad, k, k, stride, oh, ow):
        rows = slice(i, i + stride * (oh - 1) + 1, stride)
        cols = slice(j, j + stride * (ow - 1) + 1, stride)
        if mode == "max":
            hit = (v == y) & ~taken
            taken = taken | hit
            dxpad[:, :, rows, cols] += xp.where(hit, dy, xp.zeros_like(dy))
        else:
            dxpad[:, :, rows, cols] += share
    return dxpad[:, :, pad[0]:pad[0] + h, pad[2]:pad[2] + wd]


def _split_weights(wmat, wshape):
    """Filters ``(O, C/g, kh, kw)`` and bias (or None) from a weight matrix ``(O, n [+ 1])``."""
    xp = xp_of(wmat)
    n = wshape[1] * wshape[2] * wshape[3]
    w = xp.reshape(wmat[:, :n], wshape)
    return w, (wmat[:, n] if wmat.shape[1] > n else None)



def conv_block(x, wmat, wshape, stride, pad, groups, activation):
    """``f(conv(x, W) + b)`` of a cell's assembled rows; weights as one matrix."""
    w, b = _split_weights(wmat, wshape)
    return K._activate(conv2d_forward(x, w, b, stride, pad, groups), activation)



def conv_rows(x, r0, r1, wmat, wshape, stride, pad, groups, activation):
    """:func:`conv_block` of rows ``r0:r1`` of ``x``, padded by ``pad``: the output rows a
    cell computes from its own rows while its halo rows travel."""
    return conv_block(x[:, :, r0:r1, :], wmat, wshape, stride, pad, groups, activation)


def _padded_rows(x, top, bottom, start, stop):
    """Rows ``start:stop`` of ``x`` padded by ``top`` and ``bottom`` zero rows, as ``(rows
    of x, their top padding, their bottom padding)``."""
    h = x.shape[2]
    a, b = min(max(start - top, 0), h), max(min(stop - top, h), 0)
    return (x[:, :, a:max(a, b), :], max(0, min(stop, top) - start),
            max(0, stop - max(top + h, start)))


def conv_rim(x, inner, wmat, wshape, stride, pad, groups, activation, n_top, n_bottom):
    """A cell's whole output: its first ``n_top`` and last ``n_bottom`` rows computed from
    its assembled rows ``x`` (its own and the halo rows, padded by ``pad``), the rows in
    between taken from ``inner`` (:func:`conv_rows` of its own rows, computed before the
    halo rows arrived). Equal to :func:`conv_block` of ``x``."""
    xp = xp_of(x)
    kh = wshape[2]
    n_out = conv_out_size(x.shape[2], kh, stride, pad[0], pad[1])
    if n_top + inner.shape[2] + n_bottom != n_out:
        raise ValueError(f"conv_rim: {n_top} + {inner.shape[2]} + {n_bottom} rows given for "
                         f"a block of {n_out} output rows")

    def rim(o0, o1):  # output rows o0:o1 from the padded rows their windows read
        rows, top, bottom = _padded_rows(x, pad[0], pad[1], o0 * stride, (o1 - 1) * stride + kh)
        return conv_block(rows, wmat, wshape, stride, (top, bottom, pad[2], pad[3]), groups,
                          activation)

    parts = ([rim(0, n_top)] if n_top else []) + [inner] \
        + ([rim(n_out - n_bottom, n_out)] if n_bottom else [])
    return parts[0] if len(parts) == 1 else xp.concat(parts, axis=2)


def conv_block_backward(x, wmat, a, dy, wshape, stride, pad, groups, activation, need_dx):
    """``(dx_rows or None, dW matrix)`` of :func:`conv_block` for the output gradient ``dy``.

    ``a`` is the block's forward output (the activation's derivative is taken from it);
    the dW matrix has the weight matrix's layout (bias gradient as the last column).
    """
    w, b = _split_weights(wmat, wshape)
    dx, dw, db = conv2d_backward(x, w, _dz(a, dy, activation), stride, pad, groups,
                                 bias=b is not None, need_dx=need_dx)
    return dx, _weight_matrix(dw, db, wshape)


def _weight_matrix(dw, db, wshape):
    """The filters' and bias gradients in the weight matrix's layout (bias last)."""
    xp = xp_of(dw)
    dwm = xp.reshape(dw, (wshape[0], -1))
    return dwm if db is None else xp.concat([dwm, xp.reshape(db, (-1, 1))], axis=1)


def dx_rows_outputs(r0, r1, top, kh, stride, oh):
    """The output rows ``(o0, o1)`` whose windows read input rows ``r0:r1`` of a block
    padded by ``top`` rows above (output row ``o`` reads padded rows ``o * stride`` to
    ``o * stride + kh - 1``); ``o0 >= o1`` where none does."""
    return max(0, -((kh - 1 - (r0 + top)) // stride)), min(oh, (r1 - 1 + top) // stride + 1)


def _dz(a, dy, activation):
    d = K.activation_grad(a, activation)
    return dy if d is None else dy * d


def conv_dx_edges(x, wmat, a, dy, wshape, stride, pad, groups, activation, n_top, n_bottom):
    """The input-gradient contributions of a block's first ``n_top`` and last ``n_bottom``
    output rows (those whose windows reach the halo rows it read, which belong to its
    neighbours): ``(top, bottom)``, each the padded rows those windows cover (``top`` from
    padded row 0, ``bottom`` from padded row ``(oh - n_bottom) * stride``; zero rows where
    the count is 0). Computed first, so that the halo rows' gradient travels home while
    :func:`conv_block_backward_rest` runs (rim first)."""
    xp = xp_of(x)
    w, _ = _split_weights(wmat, wshape)
    n, c, _, wd = x.shape
    kh = wshape[2]
    oh, ow = dy.shape[2], dy.shape[3]
    wpad = wd + pad[2] + pad[3]

    def strip(o0, o1):
        if o1 <= o0:
            return xp.zeros((n, c, 0, wpad), dtype=x.dtype)
        dz = _dz(a[:, :, o0:o1, :], dy[:, :, o0:o1, :], activation)
        m = o1 - o0
        return _dx_padded(w, xp.reshape(dz, (n, wshape[0], m * ow)),
                          (n, c, (m - 1) * stride + kh, wpad), stride, m, ow, groups, x.dtype)

    return strip(0, n_top), strip(oh - n_bottom, oh)


def edge_rows(edges, side, r0, r1, base, pad):
    """Rows ``r0:r1`` of a block (its own row numbers; the block padded by ``pad``) from
    strip ``side`` of :func:`conv_dx_edges` (0 the top one, 1 the bottom one) whose first
    row is padded row ``base``: a new array, the halo piece sent home."""
    strip = edges[side]
    xp = xp_of(strip)
    n, c, _, wpad = strip.shape
    wd = wpad - pad[2] - pad[3]
    out = xp.zeros((n, c, r1 - r0, wd), dtype=strip.dtype)
    lo, hi = max(r0 + pad[0], base), min(r1 + pad[0], base + strip.shape[2])
    if hi > lo:
        out[:, :, lo - r0 - pad[0]:hi - r0 - pad[0], :] = \
            strip[:, :, lo - base:hi - base, pad[2]:pad[2] + wd]
    return out


def conv_block_backward_rest(x, wmat, a, dy, edges, wshape, stride, pad, groups,
                             activation, n_top, n_bottom):
    """:func:`conv_block_backward` of a block whose first ``n_top`` and last ``n_bottom``
    output rows' input-gradient contributions ``edges`` (:func:`conv_dx_edges`) came
    first: the weight gradient of every output row, the input gradient of the rows
    between, plus the edges' (each row's sum in another order than the whole backward's,
    so equal to it within rounding)."""
    xp = xp_of(x)
    w, b = _split_weights(wmat, wshape)
    n, c, h, wd = x.shape
    oh, ow = dy.shape[2], dy.shape[3]
    dz = _dz(a, dy, activation)
    _, dw, db = conv2d_backward(x, w, dz, stride, pad, groups, bias=b is not None,
                                need_dx=False)
    hpad, wpad = h + pad[0] + pad[1], wd + pad[2] + pad[3]
    dxpad = xp.zeros((n, c, hpad, wpad), dtype=x.dtype)
    m = oh - n_top - n_bottom
    if m > 0:  # the rows between the edges, into the padded image
        inner = xp.reshape(dz[:, :, n_top:oh - n_bottom, :], (n, wshape[0], m * ow))
        _dx_padded(w, inner, dxpad.shape, stride, m, ow, groups, x.dtype, out=dxpad,
                   at=n_top * stride)
    top, bottom = edges
    if top.shape[2]:
        dxpad[:, :, 0:top.shape[2], :] += top
    if bottom.shape[2]:
        at = (oh - n_bottom) * stride
        dxpad[:, :, at:at + bottom.shape[2], :] += bottom
    return dxpad[:, :, pad[0]:pad[0] + h, pad[2]:pad[2] + wd], _weight_matrix(dw, db, wshape)



def pool_block(x, k, stride, pad, mode):
    return pool2d_forward(x, k, stride, pad, mode)



def pool_block_backward(x, dy, k, stride, pad, mode):
    return pool2d_backward(x, dy, k, stride, pad, mode)
