"""Layer descriptions used to build models.

A layer here is a small frozen value; the distributed forward and backward
graphs live in :mod:`dask_ipar.nn.dense`, the local kernels in
:mod:`dask_ipar.kernels.dense`, and the analytic cost in :mod:`dask_ipar.cost`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dask_ipar.errors import IparError
from dask_ipar.kernels.dense import ACTIVATIONS

__all__ = ["Dense", "Conv2d", "MaxPool2d", "AvgPool2d", "Flatten", "resolve_padding", "check_network"]


@dataclass(frozen=True)
class Dense:
    """A fully connected layer ``y = f(W x + b)`` with ``units`` outputs.

    Parameters
    ----------
    units : int
        Output width ``d_i``.
    activation : {"linear", "relu", "tanh"} or None
        Applied to the output. The last layer of a classifier stays linear: the
        softmax lives in the cross-entropy loss.
    bias : bool
        Whether the layer has a bias (stored as an extra weight column).

    Examples
    --------
    >>> Dense(10, "relu")
    Dense(units=10, activation='relu', bias=True)
    """

    units: int
    activation: str | None = "linear"
    bias: bool = True

    def __post_init__(self):
        if not isinstance(self.units, int) or isinstance(self.units, bool) or self.units < 1:
            raise IparError(f"Dense units must be a positive integer, got {self.units!r}.")
        object.__setattr__(self, "activation", _activation(self.activation))


def _activation(name):
    """A checked activation name (None means linear)."""
    act = "linear" if name is None else name
    if act not in ACTIVATIONS:
        raise IparError(f"unknown activation {name!r}; expected one of {', '.join(ACTIVATIONS)}.")
    return act


def _pair(value, what):
    """``(a, b)`` from an int or a pair of positive ints."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value, value)
    if (not isinstance(value, tuple) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)):
        raise IparError(f"{what} must be a positive integer or a pair of them, got {value!r}.")
    return value


def _padding(padding, what):
    """'same', 'valid', an int, ``(rows, cols)`` or ``(top, bottom, left, right)``."""
    if padding in ("same", "valid"):
        return padding
    if isinstance(padding, int) and not isinstance(padding, bool):
        padding = (padding,) * 4
    elif isinstance(padding, tuple) and len(padding) == 2:
        padding = (padding[0], padding[0], padding[1], padding[1])
    if (not isinstance(padding, tuple) or len(padding) != 4
            or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0
                       for p in padding)):
        raise IparError(
            f"{what} padding must be 'same', 'valid', a non-negative int, (rows, cols) or "
            f"(top, bottom, left, right), got {padding!r}."
        )
    return padding


def resolve_padding(padding, in_hw, k, stride):
    """Explicit ``(top, bottom, left, right)`` padding of a window layer.

    'same' gives ``ceil(n / stride)`` outputs per axis (the extra row/column of an odd
    total goes to the bottom/right, as in TensorFlow and PyTorch).
    """
    if padding == "valid":
        return (0, 0, 0, 0)
    if padding == "same":
        out = []
        for n, kk, s in zip(in_hw, k, stride):
            total = max((-(-n // s) - 1) * s + kk - n, 0)
            out += [total // 2, total - total // 2]
        return tuple(out)
    return padding


@dataclass(frozen=True)
class Conv2d:
    """A 2-D convolution ``y = f(conv(x, W) + b)`` on NCHW images.

    ``parallel="domain"`` (default): image rows are split over ``Pr`` (with a halo
    exchange of the rows each window needs from a neighbour), samples over ``Pc``;
    the filters are replicated and their gradient is all-reduced over all P.
    ``parallel="model"``: the filters are split over ``Pr`` (each grid row computes
    its block of output channels on whole images), samples over ``Pc``, as a dense
    layer's rows (Eq. 8). ``parallel="batch"``: whole images, the samples of each
    grid column split again over ``Pr`` (batch-parallel over all P, Eq. 4), filters
    replicated and their gradient all-reduced over all P. The order of the layers is
    batch, then domain, then model.

    Parameters
    ----------
    filters : int
        Output channels.
    kernel_size : int or (kh, kw)
    stride : int
        The same in both directions.
    padding : 'same', 'valid', int, (rows, cols) or (top, bottom, left, right)
    activation : {"linear", "relu", "tanh"} or None
    groups : int
        Grouped convolution; must divide the input channels and ``filters`` (domain only).
    bias : bool
    parallel : {"domain", "model", "batch"}

    Examples
    --------
    >>> Conv2d(16, 3, activation="relu")
    Conv2d(filters=16, kernel_size=(3, 3), stride=1, padding='same', activation='relu', groups=1, bias=True, parallel='domain')
    """

    filters: int
    kernel_size: int | tuple = 3
    stride: int = 1
    padding: str | int | tuple = "same"
    activation: str | None = "linear"
    groups: int = 1
    bias: bool = True
    parallel: str = "domain"

    def __post_init__(self):
        if self.parallel not in ("domain", "model", "batch"):
            raise IparError(f"Conv2d parallel must be 'domain', 'model' or 'batch', got "
                            f"{self.parallel!r}.")
        if self.parallel == "model" and self.groups != 1:
            raise IparError("a model-parallel Conv2d (filters over Pr) needs groups=1; use "
                            "parallel='domain' for grouped convolutions.")
        for name in ("filters", "stride", "groups"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise IparError(f"Conv2d {name} must be a positive integer, got {v!r}.")
        object.__setattr__(self, "kernel_size", _pair(self.kernel_size, "Conv2d kernel_size"))
        object.__setattr__(self, "padding", _padding(self.padding, "Conv2d"))
        if self.filters % self.groups:
            raise IparError(f"Conv2d groups={self.groups} must divide filters={self.filters}.")
        object.__setattr__(self, "activation", _activation(self.activation))


@dataclass(frozen=True)
class _Pool2d:
    kernel_size: int
    stride: int | None = None
    padding: str | int | tuple = 0

    mode = "max"

    def __post_init__(self):
        k = self.kernel_size
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise IparError(f"{type(self).__name__} kernel_size must be a positive integer, "
                            f"got {k!r}.")
        s = k if self.stride is None else self.stride
        if not isinstance(s, int) or isinstance(s, bool) or s < 1:
            raise IparError(f"{type(self).__name__} stride must be a positive integer, got {s!r}.")
        object.__setattr__(self, "stride", s)
        object.__setattr__(self, "padding", _padding(self.padding, type(self).__name__))


@dataclass(frozen=True)
class MaxPool2d(_Pool2d):
    """Max pooling over ``kernel_size`` windows (stride defaults to the window).

    Windows that straddle two grid rows read the neighbour's rows through the halo
    exchange; the gradient goes to each window's first maximum, as in PyTorch.

    >>> MaxPool2d(2)
    MaxPool2d(kernel_size=2, stride=2, padding=(0, 0, 0, 0))
    """

    mode = "max"


@dataclass(frozen=True)
class AvgPool2d(_Pool2d):
    """Average pooling (windows cut by padding average their real elements only)."""

    mode = "avg"


@dataclass(frozen=True)
class Flatten:
    """NCHW images to feature vectors in ``(C, H, W)`` order, as ``torch.flatten(x, 1)``.

    On a grid this is the redistribution of Eq. 6: each grid row holds a strip of
    every image, the dense layer after it needs whole images, so the strips are
    all-gathered over ``Pr`` (phase ``redistribute``); its gradient goes back to
    the strips' owners as a reduce-scatter.
    """


#: The layers in front of Flatten in a CNN.
_FRONT = (Conv2d, MaxPool2d, AvgPool2d)


def check_network(layers, input_dim=None, input_shape=None):
    """Check a :class:`~dask_ipar.model.Sequential` layer list and its input; returns
    ``(n_front, input_dim, input_shape)``: the number of conv and pooling layers before
    Flatten, and the input size (``C*H*W`` for a CNN) and image shape (None for an MLP).

    Raises :class:`IparError` naming the layer for any list the engine does not run.
    """
    layers = list(layers)
    if not layers:
        raise IparError("Sequential needs at least one layer, got an empty list.")
    n_front = 0
    while n_front < len(layers) and isinstance(layers[n_front], _FRONT):
        n_front += 1
    if n_front:
        if n_front == len(layers) or not isinstance(layers[n_front], Flatten):
            raise IparError(
                f"layer {n_front} must be Flatten(): conv and pooling layers (layers "
                f"0-{n_front - 1}) are followed by Flatten() and then Dense layers."
            )
        if input_shape is None:
            raise IparError("a CNN needs input_shape=(channels, height, width).")
    elif layers and isinstance(layers[0], Flatten):
        raise IparError("Flatten() comes after conv or pooling layers, not first.")
    for k, lay in enumerate(layers[n_front + bool(n_front):], start=n_front + bool(n_front)):
        if not isinstance(lay, Dense):
            what = ("conv and pooling layers come before Flatten()"
                    if isinstance(lay, _FRONT + (Flatten,)) else
                    "Sequential takes dask_ipar Dense, Conv2d, MaxPool2d, AvgPool2d and "
                    "Flatten layers")
            raise IparError(f"layer {k} is {type(lay).__name__}; {what}.")
    if input_shape is not None:
        if (not isinstance(input_shape, (tuple, list)) or len(input_shape) != 3
                or not all(isinstance(v, int) and v >= 1 for v in input_shape)):
            raise IparError(
                f"input_shape must be (channels, height, width) of positive integers, got "
                f"{input_shape!r}."
            )
        if not n_front:
            raise IparError("input_shape is for CNNs; an MLP takes input_dim=.")
        input_shape = tuple(int(v) for v in input_shape)
        dim = input_shape[0] * input_shape[1] * input_shape[2]
        if input_dim is not None and input_dim != dim:
            raise IparError(f"input_dim={input_dim} contradicts input_shape={input_shape} "
                            f"({dim} features); give input_shape only.")
        input_dim = dim
    if not isinstance(layers[-1], Dense):
        raise IparError(f"the last layer must be Dense (the logits), got "
                        f"{type(layers[-1]).__name__}.")
    if layers[-1].activation != "linear":
        raise IparError(
            f"the last layer must be linear (it produces the logits; softmax is part of the "
            f"loss), got activation {layers[-1].activation!r}. Use Dense({layers[-1].units})."
        )
    if input_dim is not None and (not isinstance(input_dim, int) or input_dim < 1):
        raise IparError(f"input_dim must be a positive integer, got {input_dim!r}.")
    return n_front, input_dim, input_shape
