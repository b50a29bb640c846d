"""The dense layers' activations and their derivatives, array-module generic.

On NumPy blocks the passes run a slice of rows at a time (about 256 KiB, so that the bias,
the activation and the derivative's mask stay in cache: one pass over the block from memory
instead of two or three), the slices shared among the process's kernel threads
(:func:`~dask_ipar.kernels.threads.by_rows`; each element computed as before, the same
bits). CuPy blocks take whole-array ufuncs with ``out=``; other array API libraries get new
arrays.
"""

from __future__ import annotations

from dask_ipar.kernels.blocks import ufuncs_of, xp_of
from dask_ipar.kernels.threads import by_rows

__all__ = ["ACTIVATIONS", "activate_", "activation_grad", "times_activation_grad_"]

ACTIVATIONS = ("linear", "relu", "tanh")


def _activate_whole(z, activation, m):
    if activation == "relu":
        if m is not None:
            return m.maximum(z, 0, out=z)
        xp = xp_of(z)
        return xp.where(z > 0, z, xp.zeros_like(z))
    if activation == "tanh":
        return m.tanh(z, out=z) if m is not None else xp_of(z).tanh(z)
    return z


def activate_(z, activation, bias=None):
    """``f(z + bias)`` (``bias`` a column, or None); ``z`` is the caller's own new array and
    is overwritten where possible."""
    m = ufuncs_of(z)
    if m is None or (bias is None and activation not in ("relu", "tanh")):
        if bias is not None:
            z += bias
        return _activate_whole(z, activation, m)

    def rows(s0, s1, t):
        zr = z[s0:s1]
        if bias is not None:
            zr += bias[s0:s1]
        _activate_whole(zr, activation, m)

    by_rows(z, rows)
    return z


def activation_grad(a, activation):
    """Derivative of the activation, written in terms of its output ``a`` (None: identity)."""
    if activation == "relu":
        return xp_of(a).astype(a > 0, a.dtype)
    if activation == "tanh":
        return 1 - a * a
    return None


def times_activation_grad_(g, a, activation):
    """``g * f'(a)`` (``a`` the activation's output), written into ``g`` (the caller's own)."""
    m = ufuncs_of(g)
    if activation == "relu" and m is not None:
        if g.shape != a.shape:  # broadcast: whole arrays
            return m.multiply(g, a > 0, out=g)
        by_rows(g, lambda s0, s1, t: m.multiply(g[s0:s1], a[s0:s1] > 0, out=g[s0:s1]))
        return g
    d = activation_grad(a, activation)
    if d is None:
        return g
    if m is not None:
        return m.multiply(g, d, out=g)
    return g * d
