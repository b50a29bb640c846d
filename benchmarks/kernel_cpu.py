"""Where a step's CPU goes on workers that share cores, beside the step model (issue 23).

    python benchmarks/kernel_cpu.py [--model cnn] [--workers 8] [--grids 8x1,4x2]
                                    [--steps 10] [--steps-per-program 1]
                                    [--data client] [--rate 1gbit] [--json out.json]

A ``LocalCluster`` of ``--workers`` one-thread worker processes (dask-ipar's worker
settings) on this machine's cores (with ``--rate``: each in an emulated host of its own,
``netcluster.py``'s namespaces and links of that rate), calibrated as ``dask-ipar
calibrate`` does (the link figures from ``netcluster.link_check``), then per grid ``--steps`` steps of
``--model`` (``cnn``, ``compute`` or ``weight`` of ``benchmarks/common.py``; the conv
schemes the planner picks) after three untimed ones, the train-step loop of
``common.time_dask_grid`` (with ``--steps-per-program`` k: ``--steps`` submissions of
k steps each, ``fit``'s way, priced by the model at k steps a submission). Measured over
the timed steps, per step:

* each process's threads' CPU time (``psutil``), by role: the workers' program threads,
  event loops, direct-transport threads, the client's process and the scheduler's (one
  process on a ``LocalCluster``), and the whole machine's busy CPU (``/proc/stat``: the
  network stack's interrupt work too); of the workers' threads' CPU, the part spent in the
  kernel (system calls, page faults, the network stack's work charged to them), and the
  workers' page faults and context switches (``/proc``);
* each kernel's CPU time inside the programs (``dask_ipar.runtime.programs.kernel_cpu``:
  the thread's CPU clock around each call, so not the turns the other processes take),
  summed over the workers, beside the step model's price of the same kernels at the
  calibrated rates (``flops / flops_per_s`` with the product edge, plus ``bytes`` at the
  element-wise rate for the kernel's block size) before the cores' sharing, and of its CPU
  the time in the operating system's kernel (page faults, the network stack's work for the
  packets that come while it runs: ``programs.kernel_system_cpu``). Compared per call: the
  timed window is not cut at steps' ends (a submission's last updates run after
  its loss statistics are back), so a kernel's calls in it need not be whole steps'; its
  CPU a call times the model's tasks a step is set beside the model's. Before session 51
  the window's CPU was: on 2 workers' 2x1 grids a sixth of the SGD update's calls fell
  outside it, which read 0.70-0.79x its price against 0.84-0.95 a call.

Writes ``benchmarks/results/kernel-cpu-<time>.json`` (or ``--json``) and prints markdown.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


#: The key of :func:`model_costs` for the transports' CPU (per message and byte, both ends).
TRANSPORTS = "transports"
#: The key of :func:`model_costs` for the network stack's work on the kernels
#: (``stack_cpu_s_per_B`` a byte, both ends): measured as the kernels' OS-kernel time.
STACK = "network stack"
#: The key of :func:`model_costs` and of a grid's ``kernel_cpu_s`` for the programs' own
#: loops beyond their kernels and transports (``program_task_cpu_s`` a task in the model;
#: measured as ``dask-ipar calibrate`` does, :func:`dask_ipar.runtime.stepprobe.program_cpu`).
LOOPS = "program:loops"


def _thread_names():
    import threading

    return {t.native_id: t.name for t in threading.enumerate()}


def _cpu_by_thread(pids) -> dict:
    """``{(pid, thread id): (CPU seconds, of them in the OS kernel)}`` of ``pids``' threads
    (the kernel's: system calls, page faults, the network stack's work charged to them)."""
    import psutil

    out = {}
    for pid in pids:
        try:
            for th in psutil.Process(pid).threads():
                out[(pid, th.id)] = (th.user_time + th.system_time, th.system_time)
        except psutil.NoSuchProcess:
            pass
    return out


def _faults(pids) -> list:
    """``[minor page faults, major page faults, voluntary and involuntary context switches]``
    of ``pids`` together, so far (``/proc/<pid>/stat``, ``/proc/<pid>/status``)."""
    import psutil

    out = [0, 0, 0, 0]
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[0] += int(fields[7])  # minflt: the 10th field, the 3rd after the name
            out[1] += int(fields[9])  # majflt
            switches = psutil.Process(pid).num_ctx_switches()
            out[2] += switches.voluntary
            out[3] += switches.involuntary
        except (OSError, psutil.NoSuchProcess):
            pass
    return out


def _role(name) -> str:
    if name is None:
        return "BLAS and other native threads"
    if "Dask-Default-Threads" in name:
        return "program threads"
    if name == "MainThread":
        return "event loops"
    if name.startswith("ipar-wire"):
        return "direct-transport threads"
    if name.startswith("ipar-kernel"):
        return "kernel threads"
    return "other threads"


def model_costs(cfg, grid: str, layers, machine, cores=None, tasks_out=None) -> dict:
    """``{"<task>:<function>": seconds}`` per step over all workers: the step model's price
    of each kernel at ``machine``'s rates, before the sharing of cores (the element-wise
    rates as for the grid's workers taking turns on ``cores``, where given). ``tasks_out``:
    a dict that gets each kernel's tasks a step."""
    import common as C
    from dask_ipar import SGD
    from dask_ipar.nn.graph import sim_tasks
    from dask_ipar.runtime.wire import DIRECT_BYTES
    from dask_ipar.runtime.stepmodel import ELEMENTWISE_BPS, core_turns, priced, sim_step_graph
    from dask_ipar.testing import fake_binding

    shape = cfg.image if isinstance(cfg, C.CNNConfig) else (cfg.widths[0],)
    engine = cfg.build_model(layers)._make_engine(fake_binding(grid))
    names = [f"w{k}" for k in range(len(engine.param_layouts))]
    g, external = sim_step_graph(engine, names, cfg.batch, shape, "float32",
                                 SGD(lr=0.01, momentum=0.9))
    tasks, available = sim_tasks(g, external, 4)
    turns = core_turns(engine.binding.grid.size, cores)
    out: dict = collections.Counter()
    # the transports' CPU as the simulator charges it: per block and reader on another
    # worker, each end its per-message work (a small or a large message) and its bytes
    where = {t.key: (t.worker, t.out_bytes) for t in tasks}
    where.update(available)
    readers: dict = collections.defaultdict(set)
    for t in tasks:
        for d in t.deps:
            if d in where and where[d][0] != t.worker:
                readers[d].add(t.worker)
    for d, ws in readers.items():
        nbytes = where[d][1]
        per_end = ((machine.direct_message_cpu_s if nbytes <= DIRECT_BYTES
                    else machine.message_cpu_s) or 0.0) \
            + nbytes * (machine.transfer_cpu_s_per_B or 0.0)
        out[TRANSPORTS] += 2 * len(ws) * per_end
        out[STACK] += 2 * len(ws) * nbytes * (machine.stack_cpu_s_per_B or 0.0)
    out[LOOPS] = len(tasks) * (machine.program_task_cpu_s or 0.0)
    for t in priced(tasks, machine):
        name = (t.key[0] if isinstance(t.key, tuple) else t.key).split("-")[0]
        kernel = f"{name.rsplit('.', 1)[-1]}:{g.dsk[t.key].func.__name__}"
        out[kernel] += (
            t.flops / machine.flops_per_s
            + t.mem_bytes * machine.elementwise_s_per_B(t.block_bytes, ELEMENTWISE_BPS, turns,
                                                        t.kind))
        if tasks_out is not None:
            tasks_out[kernel] = tasks_out.get(kernel, 0) + 1
    return dict(out)


def measure(client, cfg, grid: str, layers, steps: int, pids: dict, names: dict,
            data: str = "client", steps_per_program: int = 1) -> dict:
    """One grid: the step time, the CPU by role and by kernel, per step (``data``: where
    the batches come from, ``common.DATA_PATHS``; ``steps_per_program``: steps per
    submission, ``fit``'s way)."""
    import common as C
    from dask_ipar import SGD

    opt = SGD(lr=0.01, momentum=0.9)
    model = cfg.build_model(layers)
    with C.step_batches(cfg, model, data) as batches:
        return _measure(client, model, opt, batches, grid, steps, pids, names,
                        steps_per_program)


def _measure(client, model, opt, batches, grid, steps, pids, names, group=1) -> dict:
    import common as C
    from distributed import wait

    from dask_ipar.runtime.linkprobe import _host_busy  # /proc/stat, as calibrate reads it
    from dask_ipar.runtime.programs import count_cost_s, kernel_cpu, kernel_system_cpu
    from dask_ipar.runtime.stepprobe import program_cpu

    model.distribute(client, grid)
    model.executor = "programs"
    try:
        def submit(s):  # submission s starts at batch s, so one step a submission alternates
            return C._submit_k(model, batches[s % 2:] + batches[:s % 2], group, opt, True)()

        for s in range(3):
            submit(s)
        client.run(kernel_cpu, True, True)
        workers = {pid: addr for addr, pid in pids.items()}
        scheduler = client.run_on_scheduler(os.getpid)
        everyone = [os.getpid(), *workers, *([scheduler] if scheduler != os.getpid() else [])]
        host0 = _host_busy()[1]
        faults0 = _faults(workers)
        before, t0 = _cpu_by_thread(everyone), time.perf_counter()
        ends = []
        for s in range(steps):  # submissions of k steps each
            submit(s)
            ends.append(time.perf_counter())
        wall = time.perf_counter() - t0
        steps *= group
        after, host1 = _cpu_by_thread(everyone), _host_busy()[1]
        faults1 = _faults(workers)
        kernels_system = client.run(kernel_system_cpu)
        kernels = client.run(kernel_cpu, False)
        client.gather(model.train_step(*batches[0], opt, more=False))
        wait([f for lay in model.state_blocks()["layers"] for f in lay["w"].values()])
    finally:
        model.close()
    roles: dict = collections.Counter()
    system: dict = collections.Counter()  # the workers' threads' time in the OS kernel
    for (pid, tid), (cpu, in_os) in after.items():
        role = ("client and scheduler process" if pid == os.getpid() == scheduler else
                "client process" if pid == os.getpid() else
                "scheduler process" if pid == scheduler else
                "workers' " + _role(names[workers[pid]].get(tid)))
        cpu0, in_os0 = before.get((pid, tid), (0.0, 0.0))
        roles[role] += (cpu - cpu0) / steps
        if pid in workers:
            system[role] += (in_os - in_os0) / steps
    per_kernel: dict = collections.Counter()
    kernel_system: dict = collections.Counter()
    for got in kernels_system.values():
        for k, sec in (got or {}).items():
            kernel_system[k] += sec / steps
    calls: dict = collections.Counter()
    for got in kernels.values():
        for k, (sec, n) in (got or {}).items():
            per_kernel[k] += sec / steps
            calls[k] += n / steps
    # the loops' own work beyond the kernels and transports, as calibrate derives it (the
    # programs' setup, like dask running them, is in step_cpu_s: not listed)
    _, per_kernel[LOOPS], _ = program_cpu(
        {k: (per_kernel[k], calls[k]) for k in per_kernel}, count_cost_s())
    for k in ("program:run", "program:start"):
        per_kernel.pop(k, None), calls.pop(k, None)
    return {"grid": grid, "step_s": statistics.median(
        b - a for a, b in zip([t0, *ends], ends)) / group, "wall_s": wall, "steps": steps,
        "steps_per_program": group,
        "cpu_by_role_s": dict(roles), "kernel_cpu_s": dict(per_kernel),
        "kernel_system_s": dict(kernel_system),
        "system_by_role_s": dict(system), "workers_faults": dict(zip(
            ("minor", "major", "voluntary switches", "involuntary switches"),
            ((b - a) / steps for a, b in zip(faults0, faults1)))),
        "host_busy_s": None if host0 is None or host1 is None else (host1 - host0) / steps,
        "kernel_calls": dict(calls)}


def render(res: dict) -> str:
    lines = [f"`python benchmarks/kernel_cpu.py --model {res['model']} --workers "
             f"{res['workers']} --grids {','.join(r['grid'] for r in res['grids'])} --steps "
             f"{res['steps']}"
             + (f" --data {res['data']}" if res.get("data", "client") != "client" else "")
             + (f" --steps-per-program {res['steps_per_program']}"
                if res.get("steps_per_program", 1) > 1 else "")
             + (f" --rate {res['rate']}" if res.get("rate") else "")
             + f"` on {res['when']} ({res['cores']} cores; raw numbers in "
             f"`{res['json']}`), per step:", ""]
    for r in res["grids"]:
        lines += [f"**{r['grid']}**: step {r['step_s']:.3f} s measured, {r['model_step_s']:.3f} s "
                  f"predicted ({r['model_step_s'] / r['step_s']:.2f}); CPU "
                  f"{sum(r['cpu_by_role_s'].values()) * 1e3:.0f} ms of the "
                  f"{res['cores'] * r['wall_s'] / r['steps'] * 1e3:.0f} ms the cores had"
                  + (f" (the machine's busy CPU, /proc/stat: {r['host_busy_s'] * 1e3:.0f} ms)"
                     if r.get("host_busy_s") is not None else "") + ".", "",
                  "| where | CPU (ms) |", "|---|---|"]
        system = r.get("system_by_role_s")
        if system:
            lines[-2:] = ["| where | CPU (ms) | of it in the OS kernel (ms) |", "|---|---|---|"]
        for role, v in sorted(r["cpu_by_role_s"].items(), key=lambda kv: -kv[1]):
            lines.append(f"| {role} | {v * 1e3:.1f} |" + (
                f" {system[role] * 1e3:.1f} |" if role in (system or {}) else
                " - |" if system else ""))
        if r.get("workers_faults"):
            lines += ["", "The workers' page faults and context switches: " + ", ".join(
                f"{v:.0f} {k}" for k, v in r["workers_faults"].items()) + "."]
        m = res["machine"]
        outside = {
            "transports' CPU": r["model_kernel_s"].get(TRANSPORTS, 0.0),
            "the network stack's work on the kernels (stack_cpu_s_per_B a byte)":
                r["model_kernel_s"].get(STACK, 0.0),
            "the programs' loops (program_task_cpu_s a task)":
                r["model_kernel_s"].get(LOOPS, 0.0),
            "a submitted step's CPU (step_cpu_s, each worker)":
                (m.get("step_cpu_s") or 0.0) * res["workers"] / r.get("steps_per_program", 1),
            "dask's background (background_cores over the step)":
                (m.get("background_cores") or 0.0) * r["model_step_s"]}
        lines += ["", "The model's CPU outside the kernels: " + "; ".join(
            f"{k} {v * 1e3:.1f} ms" for k, v in outside.items())
            + f"; {sum(outside.values()) * 1e3:.1f} ms in all."
            + (f" The kernels' time in the OS kernel, measured: "
               f"{sum(r['kernel_system_s'].values()) * 1e3:.1f} ms."
               if r.get("kernel_system_s") else "")]
        # the timed window is not cut at steps' ends: a submission's last updates run after
        # its loss statistics come back, so a kernel's calls in it are not always whole steps'
        # (e.g. 3.33 of 4 updates a step): compared per call, times the model's tasks a step
        tasks = r.get("model_kernel_tasks", {})
        in_kernel = r.get("kernel_system_s")
        lines += ["", "| kernel (task:function) | calls a step (model's tasks) | CPU (ms) | "
                  "CPU a call x tasks (ms) | model (ms) | CPU / model |"
                  + (" of the CPU in the OS kernel (ms) |" if in_kernel else ""),
                  "|---|---|---|---|---|---|" + ("---|" if in_kernel else "")]
        model = r["model_kernel_s"]
        tot_cpu = tot_model = 0.0
        for k, v in sorted(r["kernel_cpu_s"].items(), key=lambda kv: -kv[1]):
            m = None if k == LOOPS else model.get(k)  # priced outside the kernels (above)
            calls, n = r["kernel_calls"].get(k, 0), tasks.get(k)
            whole = v / calls * n if calls and n else v  # a step's CPU, whole calls
            tot_cpu += 0.0 if k == LOOPS else whole
            tot_model += m or 0.0
            ratio = f"{whole / m:.2f}" if m else "-"
            lines.append(f"| {k} | {calls:.2f}" + (f" ({n})" if n else "") + f" | {v * 1e3:.1f} | "
                         f"{whole * 1e3:.1f} | {'-' if m is None else f'{m * 1e3:.1f}'} | "
                         f"{ratio} |" + ((f" {in_kernel[k] * 1e3:.1f} |" if k in in_kernel
                                          else " - |") if in_kernel else ""))
        lines += [f"| all | | | {tot_cpu * 1e3:.1f} | {tot_model * 1e3:.1f} | "
                  f"{tot_cpu / tot_model if tot_model else float('nan'):.2f} |"
                  + (f" {sum(in_kernel.values()) * 1e3:.1f} |" if in_kernel else ""), ""]
    return "\n".join(lines)


@contextlib.contextmanager
def _cluster(workers, cores, rate):
    """A client of ``workers`` one-thread worker processes: a ``LocalCluster`` on this
    machine's cores, or with ``rate`` one emulated host per worker on links of that rate
    (``netcluster.emulated_cluster``: root)."""
    import common as C
    import netcluster as N

    if rate is None:
        cluster, client, _ = C.local_cluster(workers, cores)
        try:
            yield client
        finally:
            client.close()
            cluster.close()
        return
    from distributed import Client

    with N.emulated_cluster(workers, rate) as addr, Client(addr) as client:
        yield client


def main(argv=None):
    import dataclasses

    import common as C
    import netcluster as N
    from dask_ipar.runtime.gridrank import rank_grids

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="cnn", choices=["cnn", "compute", "weight"])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--grids", default="8x1,4x2", help="grids, comma-separated")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--data", default="client", choices=C.DATA_PATHS,
                   help="where the batches come from: the client's memory (sent every "
                        "step) or a .npy file each worker reads")
    p.add_argument("--steps-per-program", type=int, default=1,
                   help="steps per submission (fit's way); --steps counts submissions")
    p.add_argument("--rate", default=None,
                   help="one emulated host per worker on links of this rate (e.g. 1gbit; "
                        "netcluster.py's topology, needs root) instead of a LocalCluster")
    p.add_argument("--json", default=None, help="where to write the raw numbers (default: "
                   "benchmarks/results/kernel-cpu-<time>.json)")
    a = p.parse_args(argv)
    if a.steps < 2 or a.workers < 2 or a.steps_per_program < 1:
        p.error(f"--steps {a.steps}, --workers {a.workers}, --steps-per-program "
                f"{a.steps_per_program}: expected at least 2, 2 and 1")
    grids = [g.strip() for g in a.grids.split(",") if g.strip()]
    cfg = C.sweep_models()[a.model]
    cores = os.cpu_count() or 1
    path = a.json or os.path.join(HERE, "results",
                                  f"kernel-cpu-{time.strftime('%Y%m%dT%H%M%S')}.json")
    res = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cores": cores, "model": a.model,
           "workers": a.workers, "steps": a.steps, "data": a.data, "grids": [],
           "steps_per_program": a.steps_per_program, "rate": a.rate,
           "json": path if a.json else f"benchmarks/results/{os.path.basename(path)}"}
    with _cluster(a.workers, cores, a.rate) as client:
        machine = N.step_machine(client, N.link_check(client, a.rate), log=False)
        res["machine"] = dataclasses.asdict(machine)
        shape = cfg.image if isinstance(cfg, C.CNNConfig) else (cfg.widths[0],)
        ranked = {str(c.grid): c for c in rank_grids(cfg.layers(), shape, a.workers, cfg.batch,
                                                      machine, cores=cores,
                                                      executor="programs",
                                                      steps_per_program=a.steps_per_program)}
        bad = [g for g in grids if g not in ranked]
        if bad:
            p.error(f"--grids: {', '.join(bad)} not among the grids of {a.workers} workers "
                    f"for this model ({', '.join(ranked)})")
        pids, names = client.run(os.getpid), client.run(_thread_names)
        for g in grids:
            c = ranked[g]
            print(f"{cfg.label} {g} ...", file=sys.stderr, flush=True)
            r = measure(client, cfg, g, c.layers, a.steps, pids, names, a.data,
                        a.steps_per_program)
            r["model_step_s"] = c.seconds
            r["model_kernel_tasks"] = {}
            r["model_kernel_s"] = model_costs(cfg, g, c.layers, machine, cores,
                                              r["model_kernel_tasks"])
            res["grids"].append(r)
    C.write_json(path, res)
    print(render(res))


if __name__ == "__main__":
    main()
