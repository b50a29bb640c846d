"""Shapes and grid geometry of the conv and pooling layers of a network: each layer's
input and output ``(C, H, W)``, window, padding, scheme (batch, domain or model) and, for a
conv, its weight matrix's blocks; checked against the grid before any graph is built."""

from __future__ import annotations

from dataclasses import dataclass

from dask_ipar.errors import IparError
from dask_ipar.kernels.conv import conv_out_size
from dask_ipar.layout.partition import split_bounds
from dask_ipar.layout.placement import CHANNELS, SAMPLES_RC, STRIPS, WHOLE, Placement
from dask_ipar.nn.dense_layout import LayerLayout
from dask_ipar.nn.layers import Conv2d, resolve_padding

__all__ = ["FrontLayout", "front_layouts"]



@dataclass(frozen=True)
class FrontLayout:
    """Shapes and grid geometry of one conv or pooling layer."""

    index: int
    name: str
    kind: str  # "conv" or "pool"
    in_shape: tuple[int, int, int]  # (C, H, W)
    out_shape: tuple[int, int, int]
    k: tuple[int, int]
    stride: int
    pad: tuple[int, int, int, int]
    groups: int = 1
    activation: str = "linear"
    mode: str = "max"
    wshape: tuple | None = None  # conv filters (O, C/g, kh, kw)
    weights: LayerLayout | None = None  # the weight matrix's blocks (conv only)
    layout: str = "domain"  # the scheme (dask_ipar.nn.schemes): "domain", "model" or "batch"
    reads: Placement = STRIPS  # where its input lies (dask_ipar.layout.placement)
    leaves: Placement = STRIPS  # where its output lies



def front_layouts(layers, input_shape, pr: int, pc: int, first_index: int = 0):
    """Layouts of the conv/pool layers ``layers`` on a ``pr x pc`` grid; checks the shapes.

    Raises :class:`IparError` naming the layer when a layer leaves no output rows or has
    fewer output rows than ``pr`` (every grid row must own some).
    """
    shape = tuple(input_shape)
    out = []
    layout = "domain"
    where = STRIPS  # where the previous layer's output lies (the input: as the first reads)
    for off, layer in enumerate(layers):
        index = first_index + off
        c, h, w = shape
        if isinstance(layer, Conv2d):
            order = ("batch", "domain", "model")
            if order.index(layer.parallel) < order.index(layout if off else "batch"):
                raise IparError(
                    f"layer {index} (Conv2d) is {layer.parallel}-parallel but follows a "
                    f"{layout}-parallel layer; the conv layers run batch-parallel first, then "
                    "domain-parallel, then model-parallel (samples -> strips -> channel "
                    "blocks -> dense)."
                )
            layout = layer.parallel
            if layout == "model" and layer.filters < pr:
                raise IparError(
                    f"layer {index} (Conv2d, parallel='model') has {layer.filters} filters, "
                    f"fewer than the grid's Pr = {pr} rows that split them. Use a grid with "
                    f"Pr <= {layer.filters} or parallel='domain'."
                )
        elif off == 0:
            layout = "domain"  # a network that starts with pooling: strips
        if isinstance(layer, Conv2d):
            kh, kw = layer.kernel_size
            stride = layer.stride
            if c % layer.groups:
                raise IparError(f"layer {index} (Conv2d): groups={layer.groups} must divide the "
                                f"{c} input channels.")
            kind, name = "conv", f"conv{index}"
        else:
            kh = kw = layer.kernel_size
            stride = layer.stride
            kind, name = "pool", f"pool{index}"
        pad = resolve_padding(layer.padding, (h, w), (kh, kw), (stride, stride))
        oh = conv_out_size(h, kh, stride, pad[0], pad[1])
        ow = conv_out_size(w, kw, stride, pad[2], pad[3])
        if oh < 1 or ow < 1:
            raise IparError(
                f"layer {index} ({type(layer).__name__}) gets {h}x{w} images, too small for a "
                f"{kh}x{kw} window with padding {pad}: no output left. Use smaller windows or "
                "strides, more padding, or larger images."
            )
        if oh < pr and layout == "domain":
            raise IparError(
                f"layer {index} ({type(layer).__name__}) has {oh} output rows, fewer than the "
                f"grid's Pr = {pr} rows that split the images; every grid row needs at least "
                f"one. Use a grid with Pr <= {oh}, or larger images."
            )
        if kind == "conv":
            o = layer.filters
            wshape = (o, c // layer.groups, kh, kw)
            n_in = wshape[1] * kh * kw
            # blocks may be empty (fewer filters than Pr): the matrix is only stored there
            weights = LayerLayout(index=index, name=name, n_in=n_in, n_out=o, bias=layer.bias,
                                  activation=layer.activation, rows=split_bounds(o, pr),
                                  in_rows=split_bounds(n_in, pr),
                                  wcols=split_bounds(n_in + int(layer.bias), pc))
            out.append(FrontLayout(index, name, kind, shape, (o, oh, ow), (kh, kw), stride, pad,
                                   layer.groups, layer.activation, wshape=wshape,
                                   weights=weights, layout=layout, reads=_READS[layout],
                                   leaves=_LEAVES[layout]))
            shape = (o, oh, ow)
            where = _LEAVES[layout]
        else:
            out.append(FrontLayout(index, name, kind, shape, (c, oh, ow), (kh, kw), stride, pad,
                                   mode=layer.mode, layout=layout, reads=where, leaves=where))
            shape = (c, oh, ow)
    return out


#: Where a conv of each scheme reads its input and leaves its output; a pooling layer
#: reads and leaves its input's placement.
_READS = {"batch": SAMPLES_RC, "domain": STRIPS, "model": WHOLE}
_LEAVES = {"batch": SAMPLES_RC, "domain": STRIPS, "model": CHANNELS}
