"""Grids (and a CNN's conv schemes) ranked by their simulated training step, without a
cluster: the engine's step graph on placeholder workers through
:func:`dask_ipar.runtime.stepmodel.simulate_engine`. ``dask-ipar train --conv auto`` with a
calibrated machine (:func:`plan_cnn`) and the benchmarks' planner use it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from dask_ipar.cost import LOOPBACK_MACHINE
from dask_ipar.errors import IparError
from dask_ipar.layout.grid import Grid, GridBinding, factorizations, parse_grid
from dask_ipar.model import Sequential
from dask_ipar.nn.dense_layout import check_dense_grid
from dask_ipar.nn.layers import Conv2d
from dask_ipar.nn.planning import plan_layers
from dask_ipar.optim import SGD
from dask_ipar.runtime.stepmodel import simulate_engine
from dask_ipar.runtime.steps import auto_steps_of_engine, check_steps_per_program

__all__ = ["GridChoice", "simulate_layers", "rank_grids", "plan_cnn"]


@dataclass
class GridChoice:
    """One grid (and, for a CNN, its conv schemes) with its simulated step."""

    grid: Grid
    layers: list  # the layers as run there (each Conv2d's ``parallel`` set)
    seconds: float
    result: object  # the SimResult
    steps_per_program: int = 1  # steps a submission (as fit picks; priced for programs)


def _schemes_of(layers) -> tuple:
    return tuple(lay.parallel for lay in layers if isinstance(lay, Conv2d))


def _candidates(layers, input_shape, grid, batch, machine):
    """The conv scheme assignments tried on ``grid``: the alpha-beta planner's choice, then
    every conv batch-, domain- or model-parallel alike (those the engine runs)."""
    if not any(isinstance(lay, Conv2d) for lay in layers):
        return [list(layers)]
    out = []
    try:
        out.append(plan_layers(layers, input_shape, grid.size, batch, machine,
                               grid=str(grid))[1])
    except IparError:
        pass
    for scheme in ("batch", "domain", "model"):
        out.append([dataclasses.replace(lay, parallel=scheme) if isinstance(lay, Conv2d)
                    else lay for lay in layers])
    seen, unique = set(), []
    for lays in out:
        if _schemes_of(lays) not in seen:
            seen.add(_schemes_of(lays))
            unique.append(lays)
    return unique


def simulate_layers(layers, input_shape, grid, batch: int, machine, *, cores=None,
                    executor: str = "programs", optimizer=None, dtype="float32",
                    steps_per_program: int | str = 1):
    """Simulated step (a :class:`~dask_ipar.cost.SimResult`) of the network ``layers`` on
    ``grid`` without a cluster (the engine's graph on placeholder workers), run
    ``steps_per_program`` steps a submission (``"auto"``: as ``fit`` picks them on
    ``machine``, :func:`~dask_ipar.runtime.steps.auto_steps_of_engine`);
    ``input_shape``: a CNN's ``(C, H, W)`` or ``(features,)``. Raises
    :class:`~dask_ipar.errors.IparError` (or ValueError) where the engine refuses the grid."""
    return _simulate(layers, input_shape, grid, batch, machine, cores, executor, optimizer,
                     dtype, steps_per_program)[0]


def _simulate(layers, input_shape, grid, batch, machine, cores, executor, optimizer, dtype,
              steps_per_program):
    """:func:`simulate_layers` and the steps a submission it simulated: ``(result, k)``."""
    grid = parse_grid(grid)
    if len(input_shape) == 3:
        model = Sequential(list(layers), input_shape=tuple(input_shape), dtype=dtype)
    else:
        model = Sequential(list(layers), input_dim=int(input_shape[0]), dtype=dtype)
    check_dense_grid(model.dense_layers, model._first_dense, grid, model.sizes)
    engine = model._make_engine(GridBinding.placeholder(grid))  # the graph only
    w_names = [f"w{k}" for k in range(len(engine.param_layouts))]
    optimizer = optimizer or SGD(0.01, momentum=0.9)
    shape = tuple(input_shape)
    k = check_steps_per_program(steps_per_program)
    if k == "auto":
        k = auto_steps_of_engine(engine, w_names, batch, shape, model.dtype, optimizer,
                                 executor, machine, cores)
    return simulate_engine(engine, w_names, batch, shape, model.dtype, machine, cores,
                           optimizer, executor, steps_per_program=k), k


def rank_grids(layers, input_shape, procs: int, batch: int, machine, *, cores=None,
               executor: str = "programs", optimizer=None, dtype="float32", grids=None,
               steps_per_program: int | str = 1):
    """Every grid of ``procs`` processes (or ``grids``) the engine runs the network on,
    with each CNN's best conv schemes there, fastest simulated step first: a list of
    :class:`GridChoice`. ``machine`` needs ``flops_per_s`` (``dask-ipar calibrate``);
    ``steps_per_program`` as for :func:`simulate_layers`."""
    if cores is not None and (machine.background_cores or 0.0) >= cores:
        raise IparError(
            f"the machine's background_cores ({machine.background_cores:g}: dask's own CPU "
            f"while the workers compute) leaves none of the {cores} cores to the step; "
            "calibrate the machine on this cluster (dask-ipar calibrate) or lower it in the "
            "machine file.")
    out = []
    for grid in (grids or factorizations(procs)):
        grid = parse_grid(grid)
        best = None
        for lays in _candidates(layers, input_shape, grid, batch, machine):
            try:
                r, k = _simulate(lays, input_shape, grid, batch, machine, cores, executor,
                                 optimizer, dtype, steps_per_program)
            except (IparError, ValueError):
                continue  # the engine refuses these schemes on this grid
            if best is None or r.seconds < best.seconds:
                best = GridChoice(grid, lays, r.seconds, r, k)
        if best is not None:
            out.append(best)
    if not out:
        raise IparError(f"no grid of {procs} processes runs this network at batch {batch}.")
    return sorted(out, key=lambda c: c.seconds)


def plan_cnn(layers, image, procs: int, batch: int, machine, *, grid=None, machine_name="",
             dtype="float64"):
    """``--conv auto``: the grid (``grid`` kept when given) and conv schemes of a CNN, and
    the line that says what was chosen and why: ``(Grid, layers, line)``. With a machine
    that has flop rates, by the simulated step (:func:`rank_grids`); otherwise by the
    alpha-beta planner's communication (:func:`dask_ipar.nn.planning.plan_layers`)."""
    if machine is not None and machine.flops_per_s:
        best = rank_grids(layers, image, procs, batch, machine, cores=os.cpu_count(),
                          dtype=dtype, grids=[grid] if grid else None)[0]
        schemes = ", ".join(f"conv{k} {lay.parallel}" for k, lay in enumerate(best.layers)
                            if isinstance(lay, Conv2d))
        return best.grid, best.layers, (
            f"planner (conv auto): grid {best.grid}, {schemes}; simulated step "
            f"{best.seconds:.3g} s on the machine of {machine_name}")
    g, out, chosen = plan_layers(layers, image, procs, batch, machine, grid=grid)
    used = machine or LOOPBACK_MACHINE
    return g, out, (
        f"planner (conv auto): grid {g}, " + ", ".join(
            f"{n} {s}" for n, s in chosen.schemes if n.startswith("conv"))
        + f"; machine alpha {used.alpha_s:g} s, {used.bandwidth_Bps:.3g} B/s ("
        + (machine_name if machine else "the loopback default; --machine FILE from "
           "`dask-ipar calibrate` (with flop rates: the grid by simulated step) for "
           "this cluster's own") + ")")
