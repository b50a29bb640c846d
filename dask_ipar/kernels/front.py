"""The images-to-features kernels of a CNN's first dense layer (Eq. 6): the all-gather that
turns blocks of images into feature columns, and the input gradient back to image blocks,
per sample range (batch-parallel convs) or per channel or row block (model- or
domain-parallel convs). Array-API generic, like every kernel (:mod:`dask_ipar.kernels.dense`).
"""

from __future__ import annotations

from dask_ipar.kernels.blas import matmul
from dask_ipar.kernels.blocks import xp_of

__all__ = ["dx_samples", "sample_rows", "dz_samples_from_pieces", "flatten_gather",
           "dx_image_piece", "dz_image_from_pieces"]


def _as_images(cols, chw):
    """``(C*H*W, n)`` features back to NCHW images ``(n, C, H, W)``."""
    xp = xp_of(cols)
    return xp.permute_dims(xp.reshape(cols, (*chw, cols.shape[1])), (3, 0, 1, 2))


def dx_samples(wrow, dz, chw):
    """``W(i, :)^T dZ(i, :)``: the input gradient of every sample of the column, as images
    ``(n, C, H, W)`` (a strided view of one product). One product for all the pieces of
    the reduce-scatter: a product per destination's samples is a thin one (8 samples of
    the CNN benchmark's 8x1 grid: 1024 x 512 x 8, a third of one product's speed)."""
    c, h, w = chw
    return _as_images(matmul(wrow[:, :c * h * w].T, dz), chw)


def sample_rows(images, s0, s1):
    """Samples ``s0:s1`` of :func:`dx_samples`' images: a piece to send (a view; the
    transport copies a strided block once as it frames it, so a copy here would be a
    second)."""
    return images[s0:s1, ...]


def _plus_pieces(own, remote):
    """``own`` (a strided view of a fresh product) plus the remote pieces, contiguous."""
    for r in remote:
        own = own + r
    return xp_of(own).asarray(own, copy=True)


def dz_samples_from_pieces(images, s0, s1, *remote):
    """The owner's input-gradient images: its own samples ``s0:s1`` of :func:`dx_samples`
    plus those of the other grid rows."""
    return _plus_pieces(images[s0:s1, ...], remote)


def flatten_gather(axis, *blocks):
    """``(C*H*W, b)`` features, in ``(C, H, W)`` order, from blocks of ``b`` images.

    ``blocks`` are NCHW pieces of consecutive rows (``axis`` 2: height strips) or
    channels (``axis`` 1): the all-gather of the redistribution in front of the first
    dense layer.
    """
    xp = xp_of(blocks[0])
    x = xp.concat(list(blocks), axis=axis) if len(blocks) > 1 else blocks[0]
    n = x.shape[0]
    return xp.asarray(xp.reshape(x, (n, -1)).T, copy=True)


def _cols_of_block(wrow, chw, axis, a, b):
    """The columns of ``wrow`` that read channels (axis 1) or rows (axis 2) ``a:b``."""
    c, h, w = chw
    xp = xp_of(wrow)
    m = wrow.shape[0]
    if axis == 1:  # channels are contiguous in (C, H, W) order
        return wrow[:, a * h * w:b * h * w]
    block = xp.reshape(wrow[:, :c * h * w], (m, c, h, w))[:, :, a:b, :]
    return xp.reshape(block, (m, c * (b - a) * w))


def _as_block(cols, chw, axis, a, b):
    """``(features of the block, b)`` back to an NCHW block of images."""
    c, h, w = chw
    shape = (b - a, h, w) if axis == 1 else (c, b - a, w)
    xp = xp_of(cols)
    return xp.permute_dims(xp.reshape(cols, (*shape, cols.shape[1])), (3, 0, 1, 2))


def dx_image_piece(wrow, dz, chw, axis, a, b):
    """``W(i, block)^T dZ(i, j)``: the input gradient of channels or rows ``a:b``."""
    return _as_block(matmul(_cols_of_block(wrow, chw, axis, a, b).T, dz), chw, axis, a, b)


def dz_image_from_pieces(wrow, dz, chw, axis, a, b, *remote):
    """The owner's input-gradient block: its own piece plus those of the other grid rows."""
    return _plus_pieces(dx_image_piece(wrow, dz, chw, axis, a, b), remote)


