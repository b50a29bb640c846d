"""The planner choosing how a :class:`~dask_ipar.model.Sequential` CNN runs.

:func:`plan_layers` turns the model's layers into cost-model specs, asks
:func:`dask_ipar.cost.plan` for the cheapest grid and, per conv layer, the
cheapest of the schemes the engine runs (``conv="auto"``, in the engine's
order: batch-, then domain-, then model-parallel convs), and returns the
layers with their ``parallel`` set accordingly. ``dask-ipar train --model cnn
--conv auto`` uses it.
"""

from __future__ import annotations

import dataclasses

from dask_ipar.errors import IparError
from dask_ipar.nn.layers import Conv2d, Flatten

__all__ = ["cost_specs", "plan_layers"]

#: The conv schemes the engine runs, in the order it runs them.
ENGINE_SCHEMES = ("batch", "domain", "model")


def _symmetric(pad, n, k, s, out):
    """One padding per side that gives the layer's own output size (the cost model's form)."""
    lo, hi = pad
    for p in dict.fromkeys((lo, hi, (lo + hi) // 2, -(-(lo + hi) // 2))):
        if (n + 2 * p - k) // s + 1 == out:
            return p
    return max(lo, hi)


def cost_specs(layers, input_shape) -> list:
    """:mod:`dask_ipar.cost` specs of a CNN's layers, named as the engine names them
    (``conv<k>``, ``pool<k>``, ``dense<k>``; the first dense spec's ``flatten`` is
    ``flatten<k>``, the name of the flatten redistribution). For an MLP (no Flatten)
    ``input_shape`` is the input width."""
    from dask_ipar import cost
    from dask_ipar.nn.front import front_layouts

    n_front = next((k for k, lay in enumerate(layers) if isinstance(lay, Flatten)), None)
    if n_front is None:  # an MLP: ``input_shape`` is its input width
        specs, d = [], int(input_shape)
        for k, lay in enumerate(layers):
            specs.append(cost.FC(d, lay.units, bias=lay.bias, name=f"dense{k}"))
            d = lay.units
        return specs
    specs = []
    for f in front_layouts(layers[:n_front], input_shape, 1, 1):
        c, h, w = f.in_shape
        o, oh, ow = f.out_shape
        p = _symmetric(f.pad[:2], h, f.k[0], f.stride, oh)
        if f.kind == "conv":
            specs.append(cost.Conv2d(h, w, c, o, f.k[0], f.k[1], f.stride, p, f.groups,
                                     f.weights.bias, name=f.name, pad_rows=tuple(f.pad[:2])))
        else:
            specs.append(cost.Pool2d(h, w, c, f.k[0], f.stride, p, name=f.name,
                                     pad_rows=tuple(f.pad[:2])))
    c, h, w = f.out_shape
    d = c * h * w
    for k, lay in enumerate(layers[n_front + 1:], start=n_front + 1):
        # the first dense layer carries the flatten's name: its redistribution's, as the
        # engine (and the run's comm table) names it
        specs.append(cost.FC(d, lay.units, bias=lay.bias, name=f"dense{k}",
                             flatten=f"flatten{n_front}" if k == n_front + 1 else ""))
        d = lay.units
    return specs


def plan_layers(layers, input_shape, procs: int, batch: int, machine=None, *, grid=None):
    """Grid and per-layer conv schemes for a CNN, from the cost model.

    Parameters
    ----------
    layers : list
        The CNN's layers (conv and pooling, Flatten, Dense), as for ``Sequential``.
    input_shape : (C, H, W)
    procs, batch : int
        Worker processes P and mini-batch size B.
    machine : dask_ipar.cost.Machine, optional
        Default: the rough loopback figures of :data:`dask_ipar.cost.LOOPBACK_MACHINE`.
    grid : Grid or "PRxPC", optional
        Keep this grid and choose only the schemes.

    Returns
    -------
    (Grid, list of layers, dask_ipar.cost.GridPlan)
        The layers are the given ones with each Conv2d's ``parallel`` set.
    """
    from dask_ipar import cost
    from dask_ipar.cost import LOOPBACK_MACHINE
    from dask_ipar.layout.grid import Grid, parse_grid

    if not any(isinstance(lay, Flatten) for lay in layers):
        raise IparError("plan_layers plans CNNs (conv layers, Flatten, Dense layers).")
    specs = cost_specs(layers, input_shape)
    machine = machine or LOOPBACK_MACHINE
    if grid is not None:
        g = parse_grid(grid)
        best = cost.evaluate_grid(specs, g.pr, g.pc, batch, machine, conv="auto",
                                  schemes=ENGINE_SCHEMES)
        if not best.feasible:
            raise IparError(f"the planner finds no way to run this CNN on grid {g}: "
                            f"{best.reason}.")
    else:
        result = cost.plan(specs, procs, batch, machine, conv="auto", schemes=ENGINE_SCHEMES)
        if result.best is None:
            reasons = "; ".join(dict.fromkeys(gp.reason for gp in result.grids))
            raise IparError(f"the planner finds no grid of {procs} processes for this CNN at "
                            f"batch {batch}: {reasons}.")
        best = result.best
    chosen = dict(best.schemes)
    out = []
    for k, lay in enumerate(layers):
        if isinstance(lay, Conv2d):
            lay = dataclasses.replace(lay, parallel=chosen.get(f"conv{k}", "domain"))
        out.append(lay)
    return Grid(best.pr, best.pc), out, best
