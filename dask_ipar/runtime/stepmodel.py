"""The step-time model of a distributed model: its training-step graph simulated on an
alpha-beta machine with per-kernel flop and memory costs (:mod:`dask_ipar.kernels.costs`,
:func:`dask_ipar.cost.simulate_step`). Nothing is submitted to the cluster.

Dense networks and CNNs alike: the graph is the engine's own (conv and pooling blocks,
halo exchanges, the redistribution in front of the dense layers, the weight phases), the
batch's blocks shaped as the run places them. Two executors, two simulations: a task
graph (:func:`dask_ipar.cost.simulate_step`: a scheduler hop per task, the latency and
throughput views) and worker programs (:func:`dask_ipar.cost.simulate_programs`: each
worker's tasks in the step's order, blocks pushed as they exist, processor sharing on
the cores, the transports' CPU and dask's own work on shared cores; a submission's step
ends when its programs have pushed the new weights to the next step's readers, and the
next submission starts after it; within a submission of several steps a step's forward
overlaps the push before it, two steps' makespan less one's). A task's products cost their
flops and their edge (:func:`dask_ipar.kernels.cost_shapes.gemm`) at the machine's
``gemm_edge_flops`` flop-equivalents per element (:func:`priced`): a thin product runs
below a square one's rate.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from dask_ipar.cost import simulate_programs, simulate_step
from dask_ipar.errors import IparError
from dask_ipar.layout.partition import split_bounds
from dask_ipar.nn.graph import StepGraph, sim_tasks
from dask_ipar.runtime.wire import DIRECT_BYTES
from dask_ipar.runtime.placement import placement_blocks

__all__ = ["predict_step_s", "step_tasks", "sim_step_graph", "simulate_engine", "priced",
           "submission_steps", "core_turns", "ELEMENTWISE_BPS"]

#: Bytes per second of one worker's elementwise work in the kernels (copies, strided
#: im2col gathers, in-place sums) where the machine has no measured ``elementwise_Bps``
#: (``dask-ipar calibrate`` measures it), the task-graph simulation's default too.
ELEMENTWISE_BPS = 5e9


def step_tasks(engine, w_names, batch: int, input_shape, dtype, optimizer, steps: int = 1):
    """The tasks of ``steps`` consecutive training steps of ``engine`` (each step's new
    weights feeding the next) as the simulator takes them: ``(tasks, available)``
    (:func:`dask_ipar.nn.graph.sim_tasks`).

    ``w_names``: the model's weight names (one per layer with weights, convs first);
    ``input_shape``: ``(C, H, W)`` of a CNN's images or ``(features,)``.
    """
    g, external = sim_step_graph(engine, w_names, batch, input_shape, dtype, optimizer, steps)
    return sim_tasks(g, external, np.dtype(dtype).itemsize)


def sim_step_graph(engine, w_names, batch: int, input_shape, dtype, optimizer,
                   steps: int = 1):
    """The graph :func:`step_tasks` costs: ``(StepGraph, external)``, ``external`` mapping
    each weight and optimizer-state block the graph reads but does not compute to
    ``(worker, shape)``; the batch's blocks are in the graph, zeros (only their shapes
    matter to the model; ``benchmarks/step_replay.py`` runs the graph's kernels on random
    ones)."""
    grid = engine.binding.grid
    if engine.front is not None:
        engine.front.check_batch(batch)
    dtype = np.dtype(dtype)
    g = StepGraph()
    bounds = split_bounds(batch, grid.pc)
    # the batch's blocks as the run places them (features x samples, whole images or
    # image strips); zeros: only their shapes matter
    blocks, _ = placement_blocks(engine, np.zeros((batch, *input_shape), dtype), "sim.x",
                                 bounds)
    v_names = [f"sim.v{k}" for k in range(len(w_names))]
    opt = optimizer
    w, v = list(w_names), v_names
    for step in range(steps):
        x_keys, y_keys = {}, {}
        for i, j in grid.cells():
            b = bounds[j][1] - bounds[j][0]
            at = engine.binding.worker(i, j)
            x_keys[(i, j)] = g.add_data((f"sim.x{step}", i, j), at, blocks[("sim.x", i, j)])
            y_keys[(i, j)] = g.add_data((f"sim.y{step}", i, j), at, np.zeros(b, np.int64))
        g, w, v, _ = engine.train_step(x_keys, y_keys, batch, w, v, step, opt.lr,
                                       getattr(opt, "momentum", 0.0), opt.weight_decay, g=g,
                                       optimizer=opt, t=2 + step)
    lead = (2,) if opt.name in ("adam", "adamw") else ()  # Adam's state: two moments
    external = {}
    for lay, wn, vn in zip(engine.param_layouts, w_names, v_names):
        for i, (r0, r1) in enumerate(lay.rows):
            for j, (c0, c1) in enumerate(lay.wcols):
                for name, pre in ((wn, ()), (vn, lead)):
                    external[(name, i, j)] = (engine.binding.worker(i, j),
                                              (*pre, r1 - r0, c1 - c0))
    return g, external


def predict_step_s(model, batch: int, machine, *, cores: int | None = None, optimizer,
                   executor: str | None = None, steps_per_program: int = 1):
    """Predicted seconds of one training step of ``model`` (distributed) on its grid, run
    ``steps_per_program`` steps per submission (the submission's round trip, the
    machine's ``round_s``, and the push of its last step's weights are shared by its
    steps).

    ``machine`` is a :class:`dask_ipar.cost.Machine` from ``dask-ipar calibrate``
    (``alpha_s`` = seconds per dependent hop, ``message_s`` = one way between worker
    programs, ``bandwidth_Bps``, ``flops_per_s``, ``cluster_flops_per_s``,
    ``transfer_cpu_s_per_B``: the transports' CPU per byte, and ``stack_cpu_s_per_B``, the
    network stack's work that lands on the computing, charged where ``cores`` is
    given); ``cores`` shared by the workers (default: one per worker); ``executor``:
    ``"programs"`` or ``"graph"`` (default: the model's). Returns a
    :class:`dask_ipar.cost.SimResult`.
    """
    shape = model.input_shape if model.engine.front is not None else (model.input_dim,)
    return simulate_engine(model.engine, model._w, batch, shape, model.dtype, machine, cores,
                           optimizer, executor or model.executor,
                           steps_per_program=steps_per_program)


def core_turns(workers: int, cores: int | None) -> float:
    """Worker processes that take turns on each of ``cores`` cores (1 where each has its
    own, or ``cores`` is None): what a kernel's block competes with in the caches
    (:meth:`dask_ipar.cost.Machine.elementwise_s_per_B`). On 8 one-thread workers sharing
    2 cores the CNN's conv and pooling kernels took 1.2-1.7x their price at the rate of
    their own blocks' size (`benchmarks/kernel_cpu.py`), 1.06-1.3x at 4 times that. Used
    where a machine gives rates at two sizes (``elementwise_large_Bps``: calibrations before
    session 52 and machine files); one rate, as calibrated now, is that of blocks that
    stream from memory at every size."""
    return max(1.0, workers / cores) if cores else 1.0


def _step_of(key) -> int:
    name = key[0] if isinstance(key, tuple) else key
    return int(str(name).rsplit("-s", 1)[1])


def _with_push(tasks, available):
    """Two steps' tasks cut to a step in steady state that ends with its push: the first
    step's readers of the weights find them in place (the step before pushed them), and
    each task of the second step becomes a free task on its worker that reads only the
    first step's blocks, so the new weights travel to their readers and nothing of the
    second step runs."""
    first = {t.key for t in tasks if _step_of(t.key) == 0}

    def cut(t):
        if t.key in first:  # the blocks held elsewhere at the start: already pushed here
            return dataclasses.replace(t, deps=tuple(
                d for d in t.deps if d not in available or available[d][0] == t.worker))
        return dataclasses.replace(t, deps=tuple(d for d in t.deps if d in first),
                                   flops=0.0, mem_bytes=0.0, out_bytes=0.0, edge=0.0, cpu_s=0.0)
    return [cut(t) for t in tasks]


def priced(tasks, machine):
    """``tasks`` with each one's product edge added to its flops as the machine's
    ``gemm_edge_flops`` flop-equivalents per element (:class:`dask_ipar.cost.Machine`;
    unchanged where it has none): what the simulators charge at ``flops_per_s``."""
    e = machine.gemm_edge_flops or 0.0
    if not e:
        return list(tasks)
    return [dataclasses.replace(t, flops=t.flops + e * t.edge, edge=0.0) if t.edge else t
            for t in tasks]


def simulate_engine(engine, w_names, batch, input_shape, dtype, machine, cores, optimizer,
                    executor, steps_per_program: int = 1):
    """Simulated step of ``engine`` (a :class:`~dask_ipar.cost.SimResult`), as
    ``executor`` runs it, ``steps_per_program`` steps per submission (worker programs);
    the arguments as for :func:`step_tasks` and :func:`predict_step_s`."""
    if not machine.flops_per_s:
        raise IparError("the machine needs flops_per_s (run `dask-ipar calibrate`).")
    if executor not in ("programs", "graph"):
        raise IparError(f"executor: got {executor!r}; expected 'programs' or 'graph'.")

    loop_s = machine.program_task_cpu_s or 0.0

    def looped(tasks, available):  # each task's share of its program's own loop
        return ([dataclasses.replace(t, cpu_s=loop_s) for t in tasks] if loop_s and
                executor == "programs" else tasks), available

    def one_step():
        return looped(*step_tasks(engine, w_names, batch, input_shape, dtype, optimizer))

    if executor == "programs":
        workers = engine.binding.grid.size
        busy = min(workers, cores or workers)
        # what the busy cores lose to each other: the all-workers matmul rate over the
        # busy cores at the one-worker rate (1 without a cluster rate)
        shared = 1.0
        if machine.cluster_flops_per_s and busy > 1:
            shared = min(1.0, machine.cluster_flops_per_s / (busy * machine.flops_per_s))

        # a link's rate while every link is busy (a collective's), where measured lower
        link = min(machine.bandwidth_Bps, machine.exchange_Bps or machine.bandwidth_Bps)
        # and while the kernels fill the cores, where measured
        busy_link = min(link, machine.busy_exchange_Bps) if machine.busy_exchange_Bps else None
        direct_msg, comms_msg = machine.direct_message_cpu_s, machine.message_cpu_s

        def message_cpu(nbytes):  # each end's fixed work: written by the program or not
            return (direct_msg if nbytes <= DIRECT_BYTES else comms_msg) or 0.0

        # the element-wise rate by the size of a kernel's arrays, where given at two, as
        # large as the blocks of the processes that take turns on a core; the conv front's
        # strided kernels at their own rate, where measured
        turns = core_turns(workers, cores)

        def by_kind(block_bytes, kind):
            return machine.elementwise_s_per_B(block_bytes, ELEMENTWISE_BPS, turns, kind)

        mem_s_per_B = by_kind if machine.elementwise_large_Bps or machine.conv_Bps else None

        # a byte's CPU at each end: its transport's, and the network stack's work for its
        # packets that lands on whatever runs there (the kernels, outside the transports)
        per_byte = (machine.transfer_cpu_s_per_B or 0.0) + (machine.stack_cpu_s_per_B or 0.0)

        def run(tasks, available):
            return simulate_programs(
                priced(tasks, machine), flops_per_s=machine.flops_per_s, mem_s_per_B=mem_s_per_B,
                mem_Bps=machine.elementwise_Bps or ELEMENTWISE_BPS, bandwidth_Bps=link,
                latency_s=(machine.message_s if machine.message_s is not None
                           else machine.alpha_s),
                cores=cores, available=available, shared=shared,
                transfer_cpu_s_per_B=per_byte,
                message_cpu_s=message_cpu if (direct_msg or comms_msg) else 0.0,
                busy_bandwidth_Bps=busy_link, loaded_latency_s=machine.loaded_message_s,
                start_cpu_s=machine.step_cpu_s or 0.0,
                background_cores=machine.background_cores or 0.0)

        # a submission ends when its programs have pushed the last step's new weights to
        # their readers (``train_step(more=True)``, ``fit``: each program flushes its sends
        # before it ends), and the next submission's programs start after it; within a
        # submission of several steps a step's forward overlaps the push of the weights
        # before it: two steps' makespan less one's
        two_tasks, two_avail = looped(*step_tasks(engine, w_names, batch, input_shape, dtype,
                                                  optimizer, steps=2))
        pushed = run(_with_push(two_tasks, two_avail), two_avail)
        seconds = pushed.seconds + (machine.round_s or 0.0)
        if steps_per_program > 1:
            one, two = run(*one_step()), run(two_tasks, two_avail)
            seconds += (steps_per_program - 1) * (two.seconds - one.seconds)
            seconds /= steps_per_program
        return dataclasses.replace(pushed, seconds=seconds, latency_s=seconds)
    tasks, available = one_step()
    return simulate_step(priced(tasks, machine), flops_per_s=machine.flops_per_s,
                         bandwidth_Bps=machine.bandwidth_Bps, hop_s=machine.alpha_s,
                         cores=cores, available=available, task_s=machine.task_s or 0.0,
                         cluster_flops_per_s=machine.cluster_flops_per_s,
                         cluster_mem_Bps=machine.mem_Bps,
                         cluster_bandwidth_Bps=machine.cluster_bandwidth_Bps)


def submission_steps(engine, w_names, batch, input_shape, dtype, machine, cores, optimizer,
                     *, share: float, longest_s: float, most: int) -> int:
    """The fewest steps per submission, 1 to ``most``, at which what a submission costs
    beyond its steps is at most ``share`` of a step, by the step model as worker programs
    run it; fewer where a submission would last more than ``longest_s``. The model prices
    ``k`` steps a submission at ``own + submission / k`` a step (:func:`simulate_engine`:
    one step's makespan within a program, and the submission's round trip, the CPU of its
    dask tasks and the push of its last step's weights shared by its ``k``), so the two
    come from its price at one step a submission and at ``most``."""
    def step_s(k):
        return simulate_engine(engine, w_names, batch, input_shape, dtype, machine, cores,
                               optimizer, "programs", steps_per_program=k).seconds

    if most <= 1:
        return 1
    one, many = step_s(1), step_s(most)
    submission = max(0.0, (one - many) * most / (most - 1))
    own = max(one - submission, 1e-12)
    k = math.ceil(submission / (share * own) - 1e-9)
    fits = math.floor((longest_s - submission) / own + 1e-9)  # k * own + submission
    return max(1, min(most, k, fits))
