"""Layer shape descriptions for the cost model (pure Python, no arrays).

Each spec knows its input size ``d_in`` and output size ``d_out`` per sample
(the paper's d_{i-1} and d_i), its parameter count ``n_params`` (|W_i|,
bias included), and its multiply-adds per sample ``macs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FC", "Conv2d", "Pool2d", "LayerSpec", "as_layer_spec"]


def _positive(name: str, value, *, zero_ok: bool = False) -> None:
    low = 0 if zero_ok else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "non-negative" if zero_ok else "positive"
        raise ValueError(f"{name}: got {value!r}; expected a {kind} integer")


@dataclass(frozen=True)
class FC:
    """Fully connected layer ``Y = W X (+ b)``, W of shape ``d_out x d_in``.

    With ``bias=True`` the bias is stored as an extra weight column, so
    |W| = d_out * (d_in + 1). ``flatten``: the name of the flatten layer in front of a
    CNN's first dense layer (the engine's ``flatten<k>``); the redistribution of the conv
    layers' output to this layer's layout (Eq. 6) is priced under that name (under
    ``name`` when empty).
    """

    d_in: int
    d_out: int
    bias: bool = True
    name: str = ""
    flatten: str = ""

    def __post_init__(self):
        _positive("d_in", self.d_in)
        _positive("d_out", self.d_out)

    kind = "fc"

    @property
    def weight_rows(self) -> int:
        """Rows of W split over Pr (output features)."""
        return self.d_out

    @property
    def weight_cols(self) -> int:
        """Columns of W including the bias column."""
        return self.d_in + int(self.bias)

    @property
    def n_params(self) -> int:
        """|W| = d_out * (d_in + bias)."""
        return self.d_out * self.weight_cols

    @property
    def macs(self) -> int:
        """Multiply-adds per sample of the forward matmul."""
        return self.d_out * self.d_in

    # Row structure used by the exact (engine) block sizes: d = rows * row_size.
    @property
    def out_rows(self) -> tuple[int, int]:
        return (self.d_out, 1)

    @property
    def in_rows(self) -> tuple[int, int]:
        return (self.d_in, 1)


def _out_size(size: int, k: int, stride: int, padding: int, what: str) -> int:
    out = (size + 2 * padding - k) // stride + 1
    if out < 1:
        raise ValueError(
            f"{what}: input {size} with kernel {k}, stride {stride}, padding {padding} gives no output; "
            "use a smaller kernel or more padding"
        )
    return out


@dataclass(frozen=True)
class Conv2d:
    """2-D convolution on an ``in_h x in_w x in_c`` input (Eq. 2).

    |W| = k_h*k_w*(in_c/groups)*out_c (+ out_c biases); d = out_h*out_w*out_c,
    with ``out_h = (in_h + 2*padding - k_h)//stride + 1`` (same for width).
    """

    in_h: int
    in_w: int
    in_c: int
    out_c: int
    k_h: int
    k_w: int
    stride: int = 1
    padding: int = 0
    groups: int = 1
    bias: bool = True
    name: str = ""
    #: (top, bottom) zero rows when they differ from ``padding`` (the engine's exact
    #: halo geometry; the output size still follows ``padding``)
    pad_rows: tuple[int, int] | None = None
    out_h: int = field(init=False)
    out_w: int = field(init=False)

    kind = "conv"

    def __post_init__(self):
        for n in ("in_h", "in_w", "in_c", "out_c", "k_h", "k_w", "stride", "groups"):
            _positive(n, getattr(self, n))
        _positive("padding", self.padding, zero_ok=True)
        if self.in_c % self.groups or self.out_c % self.groups:
            raise ValueError(
                f"groups: got {self.groups} with in_c={self.in_c}, out_c={self.out_c}; "
                "groups must divide both channel counts"
            )
        object.__setattr__(self, "out_h", _out_size(self.in_h, self.k_h, self.stride, self.padding, "Conv2d height"))
        object.__setattr__(self, "out_w", _out_size(self.in_w, self.k_w, self.stride, self.padding, "Conv2d width"))

    @property
    def d_in(self) -> int:
        return self.in_h * self.in_w * self.in_c

    @property
    def d_out(self) -> int:
        return self.out_h * self.out_w * self.out_c

    @property
    def weight_rows(self) -> int:
        """Filters (split over Pr in the model-parallel scheme)."""
        return self.out_c

    @property
    def weight_cols(self) -> int:
        """Weights per filter including its bias."""
        return self.k_h * self.k_w * (self.in_c // self.groups) + int(self.bias)

    @property
    def n_params(self) -> int:
        return self.weight_rows * self.weight_cols

    @property
    def macs(self) -> int:
        return self.out_h * self.out_w * self.out_c * self.k_h * self.k_w * (self.in_c // self.groups)

    @property
    def halo_rows(self) -> int:
        """Rows needed from each neighbour when split along the height: floor(k_h/2) (Eq. 7)."""
        return self.k_h // 2

    @property
    def out_rows(self) -> tuple[int, int]:
        return (self.out_c, self.out_h * self.out_w)

    @property
    def in_rows(self) -> tuple[int, int]:
        return (self.in_c, self.in_h * self.in_w)


@dataclass(frozen=True)
class Pool2d:
    """Max/average pooling; no weights, no communication in the cost model."""

    in_h: int
    in_w: int
    channels: int
    k: int
    stride: int | None = None
    padding: int = 0
    global_pool: bool = False
    name: str = ""
    pad_rows: tuple[int, int] | None = None  #: as for :class:`Conv2d`
    out_h: int = field(init=False)
    out_w: int = field(init=False)

    kind = "pool"

    def __post_init__(self):
        for n in ("in_h", "in_w", "channels", "k"):
            _positive(n, getattr(self, n))
        stride = self.k if self.stride is None else self.stride
        _positive("stride", stride)
        _positive("padding", self.padding, zero_ok=True)
        object.__setattr__(self, "stride", stride)
        object.__setattr__(self, "out_h", _out_size(self.in_h, self.k, stride, self.padding, "Pool2d height"))
        object.__setattr__(self, "out_w", _out_size(self.in_w, self.k, stride, self.padding, "Pool2d width"))

    bias = False

    @property
    def d_in(self) -> int:
        return self.in_h * self.in_w * self.channels

    @property
    def d_out(self) -> int:
        return self.out_h * self.out_w * self.channels

    @property
    def n_params(self) -> int:
        return 0

    @property
    def macs(self) -> int:
        return 0


LayerSpec = FC | Conv2d | Pool2d


def as_layer_spec(layer) -> LayerSpec:
    """Normalise a layer description to a spec.

    Accepts :class:`FC`, :class:`Conv2d`, :class:`Pool2d`, or any object with
    ``d_in``/``d_out`` (or ``in_features``/``out_features``) integer attributes
    and an optional ``bias`` flag, such as the engine's dense layers.
    """
    if isinstance(layer, (FC, Conv2d, Pool2d)):
        return layer
    for a, b in (("d_in", "d_out"), ("in_features", "out_features"), ("n_in", "n_out")):
        if hasattr(layer, a) and hasattr(layer, b):
            bias = getattr(layer, "bias", True)
            bias = bool(bias) if isinstance(bias, (bool, int)) or bias is None else True
            return FC(int(getattr(layer, a)), int(getattr(layer, b)), bias=bias, name=str(getattr(layer, "name", "") or ""))
    raise ValueError(
        f"layer: got {type(layer).__name__}; expected FC, Conv2d, Pool2d or an object with "
        "d_in/d_out (or in_features/out_features) attributes"
    )
