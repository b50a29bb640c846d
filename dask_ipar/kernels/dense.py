"""The dense layers' kernels: forward, loss, the pieces of dX and dW, momentum SGD (the
images-to-features kernels of a CNN's first dense layer: :mod:`dask_ipar.kernels.front`).

Every function here is module level (so it pickles by reference) and written
against the Python array API standard: it takes the array namespace from its
inputs, so the same code runs on NumPy blocks on CPUs and CuPy blocks on
GPUs (the tests run every kernel on ``array_api_strict`` arrays too, which
reject anything outside the standard). Layout follows the paper: activations
are ``features x samples``.
"""

from __future__ import annotations

import numpy as np

from dask_ipar.kernels.activations import (
    ACTIVATIONS,
    activate_,
    activation_grad,
    times_activation_grad_,
)
from dask_ipar.kernels.blas import matmul, matmul_add
from dask_ipar.kernels.blocks import sum_pieces, ufuncs_of, xp_of
from dask_ipar.kernels.threads import SLICE_BYTES, kernel_threads, over_rows

__all__ = [
    "ACTIVATIONS",
    "span",
    "forward_segments",
    "contract_ranges",
    "dense_forward",
    "dense_forward_own",
    "dense_forward_rest",
    "activation_grad",
    "times_activation_grad_",
    "axpy_",
    "dx_piece",
    "dz_from_pieces",
    "dz_from_own",
    "dw_piece",
    "dw_reduce",
    "fused_dw_rows",
    "sgd_velocity",
    "sgd_weight",
    "sgd_update",
    "grad_block",
    "block_reduce",
    "block_sgd_velocity",
    "block_sgd_weight",
]

_ufuncs = ufuncs_of
_activate = activate_

#: Rows per slice of the chunked updates: temporaries stay about this many bytes.
_CHUNK_BYTES = 1 << 20


def _row_chunks(a, nbytes=None):
    itemsize = getattr(a.dtype, "itemsize", 8)  # array_api_strict dtypes have none
    step = max(1, (nbytes or _CHUNK_BYTES) // max(1, a.shape[1] * itemsize))
    return [(r, min(r + step, a.shape[0])) for r in range(0, a.shape[0], step)]


def axpy_(y, alpha, x):
    """``y += alpha * x`` in place, a slice of rows at a time (no temporary of ``y``'s size)."""
    if y.ndim != 2:
        y += alpha * x
        return y
    for r0, r1 in _row_chunks(y):
        y[r0:r1, ...] += alpha * x[r0:r1, ...]
    return y


def span(bounds, lo, hi, axis, *parts):
    """Indices ``lo:hi`` along ``axis`` of the concatenation of ``parts`` (``bounds[k]`` is
    the index range part ``k`` holds): a view when one part holds them all, else the
    concatenation of just the overlapping pieces."""
    xp = xp_of(parts[0])
    pieces = []
    for (b0, b1), part in zip(bounds, parts):
        a, b = max(lo, b0), min(hi, b1)
        if a < b:
            pieces.append(part[a - b0:b - b0, :] if axis == 0 else part[:, a - b0:b - b0])
    if len(pieces) == 1:
        return _aligned(pieces[0])
    return xp.concat(pieces, axis=axis)


def _aligned(one):
    """``one``, or an aligned copy of it. A block that arrived over the network can sit at
    an odd address in its message buffer; BLAS then runs far below its speed on it
    (measured: a 4 MiB-per-row dW update 3x slower). The copy (in the block's own memory
    order: a batch block arrives as a transposed view) costs one pass."""
    if isinstance(one, np.ndarray) and not one.flags.aligned:
        return one.copy(order="K")
    return one


def forward_segments(wb, xb, n_in, rows: int, cols: int):
    """How :func:`dense_forward` contracts ``W(i, :n_in) @ X(:n_in, j)`` (``rows`` x
    ``cols`` out) when ``W``'s block row comes as column slices (``wb``) and ``X`` as row
    pieces (``xb``): None to join them first (one matmul on the joined copies), else the
    contraction ranges ``(a, b)`` where both are in one part each, whose products are
    summed, no copy of either.

    Joining copies the slices of the block row (``rows * n_in``, when there are several)
    and the input pieces (``n_in * cols``); summing writes and adds one output per extra
    range (``2 * rows * cols`` each). The cheaper one is taken: summing wherever the
    weights dominate (pure batch and every grid with Pc > 1, whose block rows are
    gathered over the grid row), joining where the batch is wide against the weights.
    Shapes alone decide, so the cost model (:mod:`dask_ipar.kernels.costs`) prices
    what runs.
    """
    cuts = sorted({0, n_in} | {c for r in (*wb, *xb) for c in r if 0 < c < n_in})
    if len(cuts) <= 2:
        return None
    join = (rows * n_in if len(wb) > 1 else 0) + (n_in * cols if len(xb) > 1 else 0)
    if 2 * rows * cols * (len(cuts) - 2) >= join:
        return None
    return list(zip(cuts[:-1], cuts[1:]))


def _part(bounds, parts, a, b, axis):
    """The view ``a:b`` along ``axis`` of the one part in ``parts`` holding it."""
    for (b0, b1), part in zip(bounds, parts):
        if b0 <= a and b <= b1:
            return _aligned(part[a - b0:b - b0, :] if axis == 0 else part[:, a - b0:b - b0])
    raise ValueError(f"no part holds {a}:{b} (parts {bounds})")


def dense_forward(wb, xb, n_in, activation, *blocks):
    """``f(W[:, :n_in] @ x + b)`` for one block row of a dense layer.

    ``blocks`` are the column slices of the block row ``W(i, :)`` (``wb`` their column
    ranges; the column ``n_in``, if present, is the bias), then the row pieces of the input
    column ``X(:, j)`` (``xb`` their row ranges): the all-gathers over the grid row and
    column end here, inside the task that uses them. Blocks after those are not read (the
    task's order-only dependencies).
    """
    nw = len(wb)
    w, x = blocks[:nw], blocks[nw:nw + len(xb)]
    if forward_segments(wb, xb, n_in, w[0].shape[0], x[0].shape[1]) is None:
        z = matmul(span(wb, 0, n_in, 1, *w), span(xb, 0, n_in, 0, *x))
    else:  # a sum of products over the contraction ranges: no joined copies
        z = _contract(wb, xb, n_in, w, x)
    bias = span(wb, n_in, n_in + 1, 1, *w) if wb[-1][1] > n_in else None
    return activate_(z, activation, bias)


def contract_ranges(wb, xb, n_in):
    """The contraction ranges ``(a, b)`` of the input pieces' rows ``xb`` (clipped to
    ``:n_in``) cut where ``W``'s column slices ``wb`` end: each range lies in one slice
    and one piece, so its product needs no joined copy."""
    out = []
    for a0, b0 in xb:
        a0, b0 = max(a0, 0), min(b0, n_in)
        if a0 < b0:
            cuts = sorted({a0, b0} | {c for r in wb for c in r if a0 < c < b0})
            out += list(zip(cuts[:-1], cuts[1:]))
    return out


def _contract(wb, xb, n_in, w, x):
    """``W(i, a:b) @ X(a:b, j)`` summed over :func:`contract_ranges`; a fresh array."""
    z, tmp = None, None
    for a, b in contract_ranges(wb, xb, n_in):
        wa, xa = _part(wb, w, a, b, 1), _part(xb, x, a, b, 0)
        if z is None:
            z = matmul(wa, xa)
        else:
            z, tmp = matmul_add(z, wa, xa, tmp)
    return z


def dense_forward_own(wb, xb, n_in, *blocks):
    """The part of :func:`dense_forward`'s product its cell can compute alone:
    ``W(i, a:b) @ X(a:b, j)`` over the input rows ``X``'s own piece holds (``xb``: its
    range; ``blocks``: the weight slices of the block row, then the piece). It runs while
    the column's other pieces travel (:func:`dense_forward_rest` adds them)."""
    nw = len(wb)
    return _contract(wb, xb, n_in, blocks[:nw], blocks[nw:nw + len(xb)])


def dense_forward_rest(wb, xb, n_in, activation, own, *blocks):
    """:func:`dense_forward` from the product over the cell's own input piece (``own``,
    :func:`dense_forward_own`): the products over the other pieces (``xb``: their
    ranges), plus ``own``, the bias, the activation. Blocks after the weight slices and
    the pieces are not read (order-only dependencies)."""
    nw = len(wb)
    z = _contract(wb, xb, n_in, blocks[:nw], blocks[nw:nw + len(xb)])
    z += own
    bias = span(wb, n_in, n_in + 1, 1, *blocks[:nw]) if wb[-1][1] > n_in else None
    return activate_(z, activation, bias)


def dx_piece(wb, c0, c1, dz, *w):
    """``W(i, c0:c1)^T dZ(i, j)``: one piece of the dX reduce-scatter (``w``: the column
    slices of ``W(i, :)``, ``wb`` their ranges).

    Where ``c0:c1`` spans several slices they are joined first. (Each slice's product
    apart, never joined, was measured faster, 36-59 ms against 65-76 ms for an 8192-row
    block row at B = 64, but its last bits then depended on the memory order the blocks
    arrived in: the graph and programs executors no longer gave equal weights.)"""
    return matmul(span(wb, c0, c1, 1, *w).T, dz)


def dz_from_pieces(a, activation, wb, c0, c1, dz, *rest):
    """The reduce of the dX reduce-scatter on cell (k, j), then the activation'.

    ``rest`` is the column slices of ``W(k, :)`` (``wb`` their ranges), then the pieces
    that cells (i != k, j) computed and sent; the local piece ``W(k, c0:c1)^T dZ(k, j)``
    is computed here. ``a`` is this cell's block of the layer's input, the previous
    layer's output, whose activation' it takes.
    """
    nw = len(wb)
    g = sum_pieces(dx_piece(wb, c0, c1, dz, *rest[:nw]), *rest[nw:])
    return times_activation_grad_(g, a, activation)


def dz_from_own(a, activation, own, *remote):
    """:func:`dz_from_pieces` from the local piece computed apart (``own``, a
    :func:`dx_piece` on this cell, run while the other pieces travel): the same sum in
    the same order, into a fresh array (``own`` is another task's result), then the
    activation'."""
    return times_activation_grad_(sum_pieces(own + remote[0], *remote[1:]), a, activation)


def dw_piece(dz, xb, c0, c1, n_in, *x):
    """Columns ``c0:c1`` of ``dZ(i, j) [X(:, j); 1]^T`` (the bias is column ``n_in``).

    ``x`` is the row pieces of ``X(:, j)`` (``xb`` their ranges). With the bias column
    in the slice, its column is a row sum of ``dZ`` beside one matmul.
    """
    xp = xp_of(dz)
    if c0 >= n_in:
        return xp.sum(dz, axis=1, keepdims=True)
    xs = span(xb, c0, min(c1, n_in), 0, *x)
    if c1 <= n_in:
        return matmul(dz, xs.T)
    m = _ufuncs(dz)
    if m is not None:  # one matmul into the slice's first columns, the bias sum beside it
        out = m.empty((dz.shape[0], c1 - c0), dtype=dz.dtype)
        matmul(dz, xs.T, out=out[:, :n_in - c0])
        m.sum(dz, axis=1, out=out[:, n_in - c0])
        return out
    ones = xp.ones((1, xs.shape[1]), dtype=xs.dtype)
    return matmul(dz, xp.concat([xs, ones], axis=0).T)


def dw_reduce(dz, xb, c0, c1, n_in, *rest):
    """The reduce of the dW reduce-scatter on cell (i, j): the local piece (from the input
    pieces, the first ``len(xb)`` of ``rest``) plus the remote pieces (the others)."""
    nx = len(xb)
    return sum_pieces(dw_piece(dz, xb, c0, c1, n_in, *rest[:nx]), *rest[nx:])


def sgd_velocity(w, momentum, weight_decay, n_decay, v, dz, xb, c0, c1, n_in, *rest):
    """``v <- momentum * v + g + weight_decay * w`` for the owned slice ``w``
    (columns ``c0:c1`` of the layer).

    ``g`` is the reduced dW slice (:func:`dw_reduce` of the local and remote
    pieces); weight decay applies to the first ``n_decay`` columns of the slice
    (not to the bias column). ``v`` is None on the first step (then ``v = g``).

    On NumPy and CuPy blocks the new velocity is written into ``v``'s buffer, a slice of
    rows at a time (the local dW piece too, about 16 MiB of it at a time), so no array the
    size of a large block is allocated: ``v`` is the cell's long-lived momentum block,
    which only this task reads (see :class:`dask_ipar.nn.dense.Engine`). Other array libraries, and blocks this process may
    not overwrite, get a new array.
    """
    m = None if v is None else _ufuncs(v)
    if m is None or not _writable(v):
        g = dw_reduce(dz, xb, c0, c1, n_in, *rest)
        if weight_decay and n_decay:
            axpy_(g[:, :n_decay], weight_decay, w[:, :n_decay])
        return g if v is None else axpy_(g, momentum, v)
    return _momentum_rows(m, w, v, None, momentum, weight_decay, n_decay, dz, xb, c0, c1,
                          n_in, *rest)


def fused_dw_rows(m, like, full, dz, xb, c0, c1, n_in, *rest, finish):
    """The driver of the fused in-place updates (momentum SGD's :func:`_momentum_rows`,
    Adam's ``kernels.adam._adam_rows``): the local dW product of the slice shaped as
    ``like`` (columns ``c0:c1`` of the layer; ``rest``: the input pieces, then the remote
    dW pieces) one matmul per chunk of about 16 MiB of rows (smaller products lose BLAS
    speed) into one scratch buffer, each chunk then handed on in sub-slices that stay in
    cache: ``finish(g, s0, s1, t, nw, bias, remote)`` with ``g`` the scratch rows of
    ``s0:s1`` (their first ``nw`` columns the product; all ``like``'s columns with
    ``full``, else just those), ``t`` the kernel thread, ``bias`` the bias column's
    gradient (or None), ``remote`` the remote pieces. ``m`` is the array module (NumPy or
    CuPy): NumPy's sub-slices are shared among the process's kernel threads
    (:func:`~dask_ipar.kernels.threads.over_rows`: each by one thread, the same bits on
    any number); CuPy gets whole chunks."""
    nx = len(xb)
    remote = rest[nx:]
    nw = max(0, min(c1, n_in) - c0)  # weight columns of the slice (then maybe the bias)
    xs = span(xb, c0, c0 + nw, 0, *rest[:nx]) if nw else None
    bias = m.sum(dz, axis=1) if c1 > n_in else None
    chunks = _row_chunks(like, 16 * _CHUNK_BYTES)
    width = like.shape[1] if full else nw
    tmp = m.empty((chunks[0][1], width), dtype=like.dtype) if width else None
    sub = _row_chunks(like, SLICE_BYTES)[0][1] if m is np else chunks[0][1]
    threads = kernel_threads() if m is np else 1

    def part(s0, s1, t, r0):
        finish(None if tmp is None else tmp[s0 - r0:s1 - r0], s0, s1, t, nw, bias, remote)

    for r0, r1 in chunks:
        if nw:
            matmul(dz[r0:r1, :], xs.T, out=tmp[:r1 - r0, :nw])
        over_rows(lambda s0, s1, t, r0=r0: part(s0, s1, t, r0), r0, r1, sub, threads)


def _momentum_rows(m, w, v, lr, momentum, weight_decay, n_decay, dz, xb, c0, c1, n_in,
                   *rest):
    """The in-place momentum step of :func:`sgd_velocity` (and, with ``lr``, the weight
    step of :func:`sgd_update`), fused (:func:`fused_dw_rows`): each sub-slice gets
    ``v = momentum * v + dW + remote pieces + weight_decay * w``, then ``w -= lr * v``
    while ``v`` is still in cache (one pass over ``v`` and ``w`` from memory instead of
    four). ``m`` is the array module (NumPy or CuPy)."""
    scratch = {}  # per kernel thread, for ``-lr * v``

    def finish(g, s0, s1, t, nw, bias, remote):
        vr = v[s0:s1, :]
        vr *= momentum
        if nw:
            vr[:, :nw] += g
        if bias is not None:
            vr[:, nw] += bias[s0:s1]
        for r in remote:
            vr += r[s0:s1, :]
        if weight_decay and n_decay:
            vr[:, :n_decay] += weight_decay * w[s0:s1, :n_decay]
        if lr is not None:
            sc = scratch.get(t)
            if sc is None or sc.shape[0] < s1 - s0:
                sc = scratch[t] = m.empty((s1 - s0, v.shape[1]), dtype=v.dtype)
            sc = sc[:s1 - s0]
            m.multiply(vr, -lr, out=sc)
            w[s0:s1, :] += sc

    fused_dw_rows(m, v, False, dz, xb, c0, c1, n_in, *rest, finish=finish)
    return v


def sgd_update(w, v, lr, momentum, weight_decay, n_decay, in_place, n_after, dz, xb, c0, c1,
               n_in, *rest):
    """Momentum SGD on the owned slice in one task: the velocity block ``v`` is updated in
    place (:func:`sgd_velocity`; libraries without ``out=`` copy the result back in), then
    the weights ``w - lr * v``.

    ``v`` is a long-lived state block that only this cell's update reads; the engine
    orders successive updates of a cell through their weights. With ``in_place`` the new
    weights are written into ``w`` (NumPy and CuPy blocks, ``w`` and ``v`` both writeable,
    aligned and C-contiguous; otherwise a new array): the engine passes as the last
    ``n_after`` arguments the tasks of this cell that read ``w``, so that they run first
    (their values are unused).
    ``rest``: the input pieces (``len(xb)``), the remote dW pieces, those tasks.
    """
    if n_after:
        rest = rest[:-n_after]
    m = _ufuncs(w)
    if in_place and m is not None and _ufuncs(v) is m and _writable(w) and _writable(v):
        _momentum_rows(m, w, v, lr, momentum, weight_decay, n_decay, dz, xb, c0, c1, n_in,
                       *rest)
        return w
    new_v = sgd_velocity(w, momentum, weight_decay, n_decay, v, dz, xb, c0, c1, n_in, *rest)
    if new_v is not v:
        v[...] = new_v
    return sgd_weight(w, v, lr)


def nesterov_update(w, v, lr, momentum, weight_decay, n_decay, dz, xb, c0, c1, n_in, *rest):
    """Nesterov momentum on the owned slice (``torch.optim.SGD(nesterov=True)``):
    ``g = dW + weight_decay * w``, ``v <- momentum * v + g`` (in place), and the new
    slice ``w - lr * (g + momentum * v)`` (a new array). ``rest`` as for
    :func:`sgd_update` (no readers: the slice is not rewritten)."""
    g = dw_reduce(dz, xb, c0, c1, n_in, *rest)
    if weight_decay and n_decay:
        axpy_(g[:, :n_decay], weight_decay, w[:, :n_decay])
    if _writable(v):
        v *= momentum
        axpy_(v, 1.0, g)
    else:
        v[...] = v * momentum + g
    d = axpy_(g, momentum, v)  # g is this task's own array
    return sgd_weight(w, d, lr)


def _writable(x):
    """Whether a NumPy or CuPy block may be overwritten in place: writeable, aligned and
    C-contiguous (CuPy blocks have no writeable/aligned flags: always both)."""
    flags = x.flags
    return bool(getattr(flags, "writeable", True) and getattr(flags, "aligned", True)
                and flags.c_contiguous)


def sgd_weight(w, v, lr):
    """``w <- w - lr * v`` for the owned slice ``w`` (one new array)."""
    out = v * (-lr)
    out += w
    return out


# ------------------------------------------- replicated (conv) weight matrices


def grad_block(grad, r0, r1, c0, c1):
    """Block ``[r0:r1, c0:c1]`` of the weight-gradient partial ``grad[1]`` (a piece to send),
    or of a block ``(r_off, c_off, g)`` that starts at row ``r_off``, column ``c_off`` (a
    clipped gradient block, :func:`clip_grad`)."""
    if len(grad) == 3:
        r_off, c_off, g = grad
        return xp_of(g).asarray(g[r0 - r_off:r1 - r_off, c0 - c_off:c1 - c_off], copy=True)
    g = grad[1]
    return xp_of(g).asarray(g[r0:r1, c0:c1], copy=True)


def block_reduce(grad, r0, r1, c0, c1, *remote):
    """This cell's block of the summed weight gradient: its own partial plus the pieces."""
    out = grad_block(grad, r0, r1, c0, c1)
    for r in remote:
        out += r
    return out


def block_sgd_velocity(wfull, r0, r1, c0, c1, momentum, weight_decay, n_decay, v, grad,
                       *remote):
    """:func:`sgd_velocity` for block ``[r0:r1, c0:c1]`` of a replicated weight matrix.

    ``wfull`` is this cell's gathered copy of the whole matrix; weight decay applies to
    the first ``n_decay`` columns of the block (not to the bias column).
    """
    g = block_reduce(grad, r0, r1, c0, c1, *remote)
    if weight_decay and n_decay:
        axpy_(g[:, :n_decay], weight_decay, wfull[r0:r1, c0:c0 + n_decay])
    return g if v is None else axpy_(g, momentum, v)


def block_nesterov_weight(wfull, r0, r1, c0, c1, v, v_old, lr, momentum):
    """Nesterov's step for block ``[r0:r1, c0:c1]`` of ``wfull``: the direction
    ``g + momentum * v`` is ``(1 + momentum) * v - momentum * v_old`` (``v = momentum *
    v_old + g``; ``v_old`` None on the first step, when ``v = g``)."""
    d = v * (1 + momentum)
    if v_old is not None:
        d -= momentum * v_old
    return block_sgd_weight(wfull, r0, r1, c0, c1, d, lr)


def block_sgd_weight(wfull, r0, r1, c0, c1, v, lr):
    """``w <- w - lr * v`` for block ``[r0:r1, c0:c1]`` of ``wfull``."""
    out = v * (-lr)
    out += wfull[r0:r1, c0:c1]
    return out
