"""Built-in network shapes: AlexNet, VGG-16, ResNet-50 and MLPs."""

from __future__ import annotations

from collections.abc import Sequence

from dask_ipar.cost.layers import FC, Conv2d, LayerSpec, Pool2d, as_layer_spec

__all__ = ["alexnet", "vgg16", "resnet50", "mlp", "from_units", "get_network", "NETWORKS", "count_params"]


def alexnet(num_classes: int = 1000) -> list[LayerSpec]:
    """AlexNet with the standard grouped shapes (Krizhevsky 2012; paper.md table).

    5 conv + 3 FC layers, 60,965,224 parameters with biases.
    """
    return [
        Conv2d(227, 227, 3, 96, 11, 11, stride=4, name="conv1"),
        Pool2d(55, 55, 96, 3, 2, name="pool1"),
        Conv2d(27, 27, 96, 256, 5, 5, padding=2, groups=2, name="conv2"),
        Pool2d(27, 27, 256, 3, 2, name="pool2"),
        Conv2d(13, 13, 256, 384, 3, 3, padding=1, name="conv3"),
        Conv2d(13, 13, 384, 384, 3, 3, padding=1, groups=2, name="conv4"),
        Conv2d(13, 13, 384, 256, 3, 3, padding=1, groups=2, name="conv5"),
        Pool2d(13, 13, 256, 3, 2, name="pool5"),
        FC(9216, 4096, name="fc6"),
        FC(4096, 4096, name="fc7"),
        FC(4096, num_classes, name="fc8"),
    ]


def vgg16(num_classes: int = 1000) -> list[LayerSpec]:
    """VGG-16 (configuration D) on 224 x 224 x 3 inputs; 138,357,544 parameters."""
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
    layers: list[LayerSpec] = []
    h, c, block, idx = 224, 3, 1, 1
    for v in cfg:
        if v == "M":
            layers.append(Pool2d(h, h, c, 2, 2, name=f"pool{block}"))
            h //= 2
            block += 1
            idx = 1
        else:
            layers.append(Conv2d(h, h, c, v, 3, 3, padding=1, name=f"conv{block}_{idx}"))
            c = v
            idx += 1
    layers += [FC(7 * 7 * 512, 4096, name="fc6"), FC(4096, 4096, name="fc7"), FC(4096, num_classes, name="fc8")]
    return layers


def resnet50(num_classes: int = 1000) -> list[LayerSpec]:
    """ResNet-50 (v1.5: stride on the 3 x 3 conv) on 224 x 224 x 3 inputs.

    Every convolution is listed, including the 1 x 1 bottleneck convs and the
    1 x 1 projection shortcuts; convs have no bias (batch norm follows), so
    the count is 25,503,912 (torchvision's 25,557,032 minus 53,120 batch-norm
    parameters).  Residual branches are flattened into one sequence: each
    layer keeps its own true input shape, and the projection conv is listed
    right after its block's last conv.
    """
    layers: list[LayerSpec] = [
        Conv2d(224, 224, 3, 64, 7, 7, stride=2, padding=3, bias=False, name="conv1"),
        Pool2d(112, 112, 64, 3, 2, padding=1, name="pool1"),
    ]
    h, c = 56, 64
    for stage, (width, blocks, stride) in enumerate(((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)), start=2):
        out_c = width * 4
        for b in range(blocks):
            s = stride if b == 0 else 1
            p = f"layer{stage - 1}.{b}"
            c1 = Conv2d(h, h, c, width, 1, 1, bias=False, name=f"{p}.conv1")
            c2 = Conv2d(h, h, width, width, 3, 3, stride=s, padding=1, bias=False, name=f"{p}.conv2")
            c3 = Conv2d(c2.out_h, c2.out_w, width, out_c, 1, 1, bias=False, name=f"{p}.conv3")
            layers += [c1, c2, c3]
            if b == 0:
                layers.append(Conv2d(h, h, c, out_c, 1, 1, stride=s, bias=False, name=f"{p}.downsample"))
            h, c = c2.out_h, out_c
    layers.append(Pool2d(h, h, c, h, name="avgpool", global_pool=True))
    layers.append(FC(c, num_classes, name="fc"))
    return layers


def mlp(widths: Sequence[int], *, bias: bool = True) -> list[LayerSpec]:
    """Multi-layer perceptron from a width list ``[d_0, d_1, ..., d_L]``."""
    widths = list(widths)
    if len(widths) < 2:
        raise ValueError(f"widths: got {widths!r}; expected at least two widths such as [784, 4096, 10]")
    for w in widths:
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"widths: got {widths!r}; every width must be a positive integer")
    return [FC(a, b, bias=bias, name=f"fc{i + 1}") for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))]


def from_units(layers, input_dim: int) -> list[LayerSpec]:
    """FC specs from engine-style dense layers that know only their output width.

    Each item needs a ``units`` attribute (and optionally ``bias``), as the
    engine's ``Dense``; ``input_dim`` is the width of the network input.
    """
    if isinstance(input_dim, bool) or not isinstance(input_dim, int) or input_dim < 1:
        raise ValueError(
            f"input_dim: got {input_dim!r}; expected the positive input width (e.g. Sequential(..., input_dim=64))"
        )
    specs, d = [], input_dim
    for i, layer in enumerate(layers):
        units = getattr(layer, "units", None)
        if isinstance(units, bool) or not isinstance(units, int) or units < 1:
            raise ValueError(f"layers[{i}]: got {layer!r}; expected a dense layer with a positive integer 'units'")
        specs.append(FC(d, units, bias=bool(getattr(layer, "bias", True)), name=f"dense{i}"))
        d = units
    return specs


NETWORKS = {"alexnet": alexnet, "vgg16": vgg16, "resnet50": resnet50}


def get_network(name_or_widths) -> list[LayerSpec]:
    """Resolve a network: ``"alexnet"``, ``"vgg16"``, ``"resnet50"``, a width
    string such as ``"784,4096,4096,10"``, a list of widths, a list of layer
    specs, or an engine model with ``layers`` (each with ``units``) and ``input_dim``.
    """
    if isinstance(name_or_widths, str):
        text = name_or_widths.strip()
        key = text.lower().replace("-", "").replace("_", "")
        if key in NETWORKS:
            return NETWORKS[key]()
        parts = [p.strip() for p in text.replace("x", ",").split(",") if p.strip()]
        if len(parts) >= 2 and all(p.isdigit() for p in parts):
            return mlp([int(p) for p in parts])
        raise ValueError(
            f"model: got {name_or_widths!r}; expected one of {', '.join(NETWORKS)} or a comma-separated "
            "width list such as 784,4096,4096,10"
        )
    if hasattr(name_or_widths, "layers") and hasattr(name_or_widths, "input_dim"):
        # an engine model such as dask_ipar.Sequential (duck-typed: no dask import here)
        return from_units(name_or_widths.layers, name_or_widths.input_dim)
    items = list(name_or_widths)
    if items and all(isinstance(x, int) and not isinstance(x, bool) for x in items):
        return mlp(items)
    if not items:
        raise ValueError("model: got an empty list; expected layers or widths")
    return [as_layer_spec(x) for x in items]


def count_params(layers: Sequence[LayerSpec]) -> int:
    """Total parameter count sum_i |W_i|."""
    return sum(layer.n_params for layer in layers)
