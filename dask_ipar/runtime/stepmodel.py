"""The step-time model of a distributed model: its training-step graph simulated on an
alpha-beta machine with per-kernel flop and memory costs (:mod:`dask_ipar.kernels.costs`,
:func:`dask_ipar.cost.simulate_step`). Nothing is submitted to the cluster.
"""

from __future__ import annotations

import numpy as np

from dask_ipar.cost import simulate_step
from dask_ipar.errors import IparError
from dask_ipar.layout.partition import split_bounds
from dask_ipar.nn.graph import StepGraph, sim_tasks

__all__ = ["predict_step_s"]


def predict_step_s(model, batch: int, machine, *, cores: int | None = None, optimizer):
    """Predicted seconds of one training step of ``model`` (distributed) on its grid.

    ``machine`` is a :class:`dask_ipar.cost.Machine` from ``dask-ipar calibrate``
    (``alpha_s`` = seconds per dependent hop, ``bandwidth_Bps``, ``flops_per_s``);
    ``cores`` shared by the workers (default: one per worker). Returns a
    :class:`dask_ipar.cost.SimResult`.
    """
    if model._n_front:
        raise IparError("step-time prediction covers dense networks only, not conv layers "
                        "yet.")
    if not machine.flops_per_s:
        raise IparError("the machine needs flops_per_s (run `dask-ipar calibrate`).")
    grid = model.binding.grid
    g = StepGraph()
    bounds = split_bounds(batch, grid.pc)
    x_keys, y_keys = {}, {}
    for i, j in grid.cells():
        b = bounds[j][1] - bounds[j][0]
        w = model.binding.worker(i, j)
        x_keys[(i, j)] = g.add_data(("sim.x", i, j), w, np.zeros((model.input_dim, b),
                                                                 model.dtype))
        y_keys[(i, j)] = g.add_data(("sim.y", i, j), w, np.zeros(b, np.int64))
    v_names = [f"sim.v{k}" for k in range(len(model.layers))]
    opt = optimizer
    g, _, _, _ = model.engine.train_step(x_keys, y_keys, batch, model._w, v_names, 0,
                                        opt.lr, getattr(opt, "momentum", 0.0),
                                        opt.weight_decay, g=g, optimizer=opt, t=2)
    lead = (2,) if opt.name in ("adam", "adamw") else ()  # Adam's state: two moments
    external = {}
    for lay, wn, vn in zip(model.engine.param_layouts, model._w, v_names):
        for i, (r0, r1) in enumerate(lay.rows):
            for j, (c0, c1) in enumerate(lay.wcols):
                for name, pre in ((wn, ()), (vn, lead)):
                    external[(name, i, j)] = (model.binding.worker(i, j),
                                              (*pre, r1 - r0, c1 - c0))
    tasks, available = sim_tasks(g, external, model.dtype.itemsize)
    return simulate_step(tasks, flops_per_s=machine.flops_per_s,
                         bandwidth_Bps=machine.bandwidth_Bps, hop_s=machine.alpha_s,
                         cores=cores, available=available, task_s=machine.task_s or 0.0,
                         cluster_flops_per_s=machine.cluster_flops_per_s,
                         cluster_mem_Bps=machine.mem_Bps,
                         cluster_bandwidth_Bps=machine.cluster_bandwidth_Bps)

