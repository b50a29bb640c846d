"""One benchmark run, side by side on this machine; writes docs/benchmarks.md and a JSON.

    python benchmarks/run.py [--quick] [--out docs/benchmarks.md] [--netcluster]

Measures, in one run: the NumPy single-process step (the compute limit), dask-ipar on
every grid of 1, 2 and 4 workers, PyTorch DDP (gloo, CPU) on 1, 2 and 4 processes when
torch is installed, the planner's grid vs pure batch, a per-step overhead profile and
peak memory per worker. ``--netcluster`` also runs benchmarks/netcluster.py (root; the
emulated 1 Gbit/s cluster) and folds its numbers into the same report.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import common as C  # noqa: E402

LIMITS = {  # the targets
    "t1": 1.10, "t2_ms": 10.0, "t3": 1.0, "t4": 1.5, "t5": 0.35,
    "t1_torch": 1.05,  # issue 23
}


def kept_sections(path) -> str:
    """The sections of ``path`` between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``
    markers: written by other benchmark scripts, carried over when this one rewrites it."""
    import re

    try:
        with open(path) as fh:
            old = fh.read()
    except OSError:
        return ""
    blocks = re.finditer(r"<!-- (\w+):begin -->.*?<!-- \1:end -->", old, flags=re.S)
    return "".join("\n" + b.group(0) + "\n" for b in blocks)


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def verdict(ok):
    return "PASS" if ok else "MISS"


# ------------------------------------------------------------------ measuring
#: The executors every dask-ipar row is measured with, where their results go in the JSON
#: (runs before the programs executor have the graph executor's only).
EXECUTORS = ("graph", "programs")
SLOT = {"graph": "dask", "programs": "programs"}
SUFFIX = {"graph": "", "programs": "_programs"}


def measure(quick: bool, cores: int, netcluster: bool) -> dict:
    cfgs = C.configs(quick)
    steps = 2 if quick else 5
    res = {
        "when": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "quick": quick, "cores": cores, "steps": steps, "method": 4,
        "host": {"python": platform.python_version(), "numpy": np.__version__,
                 "cpu": platform.processor() or platform.machine(),
                 "loadavg_start": os.getloadavg()},
        "configs": {c.key: {"widths": c.widths, "batch": c.batch, "flops": c.flops,
                            "params": c.params, "label": c.label} for c in cfgs},
        "numpy": {}, "dask": {c.key: {} for c in cfgs}, "torch": {c.key: {} for c in cfgs},
        "programs": {c.key: {} for c in cfgs}, "executors": list(EXECUTORS),
    }
    import dask
    import distributed
    res["host"].update(dask=dask.__version__, distributed=distributed.__version__)

    log("sgemm ceiling")
    res["sgemm_gflops"] = C.time_sgemm(2048 if quick else 4096)
    for c in cfgs:
        log(f"numpy {c.label}")
        res["numpy"][c.key] = C.time_numpy(c, steps)
        res["numpy"][c.key]["first_loss"] = _numpy_first_loss(c)

    for p in (1, 2, 4):
        log(f"LocalCluster with {p} workers")
        cluster, client, threads = C.local_cluster(p, cores)
        try:
            res.setdefault("threads", {})[str(p)] = threads
            workers = sorted(client.scheduler_info()["workers"])
            if p == 2:
                big, small = C.transfer_time(client, workers[0], workers[1], 64 * 2**20)
                res["loopback"] = {"t_64MiB_s": big, "t_4B_s": small,
                                   "bandwidth_Bps": 64 * 2**20 / max(big - small, 1e-9),
                                   "alpha_s": small}
            for c in cfgs:
                for pr, pc in C.grids_of(p):
                    g = f"{pr}x{pc}"
                    for ex in EXECUTORS:  # side by side: both executors of each grid
                        log(f"dask {c.label} {g} ({ex})")
                        if p == 4:
                            # fresh worker processes: peak memory is this grid's, not what
                            # the allocator kept from the grids before it (a new cluster:
                            # back-to-back `client.restart()` calls sometimes lose all the
                            # workers, with or without dask-ipar's code in them)
                            client.close()
                            cluster.close()
                            cluster, client, _ = C.local_cluster(p, cores)
                        r = C.time_dask_grid(client, c, g, steps, warmup=1,
                                             memory=(p == 4), executor=ex)
                        res[SLOT[ex]][c.key][g] = r
                        log(f"   step {r['step_s']:.3f} s")
            if p == 4:
                for ex in EXECUTORS:
                    log(f"tiny MLP on 2x2 (overhead only, {ex})")
                    key = "tiny_2x2" + SUFFIX[ex]
                    res[key] = C.time_dask_grid(client, C.TINY, "2x2", 5, warmup=2, executor=ex)
                    res[key]["widths"] = C.TINY.widths
        finally:
            client.close()
            cluster.close()
        if p == 1:
            # target 1 side by side: the NumPy step again right after the 1x1 runs (the
            # cluster closed), so that a drift of the machine's speed between the two
            # measurements shows (the target uses the mean of both)
            for c in cfgs:
                if c.key == "compute":
                    log(f"numpy {c.label} again, after 1x1")
                    res["numpy_after_1x1"] = C.time_numpy(c, steps)

    log("scheduler in its own process: overhead on 2x2")
    for ex in EXECUTORS:
        own = res["own_scheduler" + SUFFIX[ex]] = {}
        for c in [cf for cf in cfgs if cf.key == "compute"] + [C.TINY]:
            log(f"   {c.label} ({ex})")
            # dask's own floor (no-op kernels) is a property of the task graph: graph only
            own[c.key] = C.time_own_scheduler(c, "2x2", 10 if c is C.TINY else steps,
                                              floor=ex == "graph", executor=ex)
            own[c.key]["widths"] = c.widths
        # per added layer vs per step: the tiny MLP at three depths (same grid and batch)
        depth = res["depth" + SUFFIX[ex]] = []
        for layers in ((2, 4) if quick else (2, 4, 8)):
            c = C.tiny_of_depth(layers)
            log(f"   {c.label} ({ex})")
            r = C.time_own_scheduler(c, "2x2", 30, floor=False, executor=ex)
            depth.append({"layers": layers, "widths": c.widths, **r})

    if C.torch_available():
        import torch
        res["host"]["torch"] = torch.__version__
        for c in cfgs:
            for p in ((2, 4) if quick else (1, 2, 4)):
                log(f"torch {'DDP ' if p > 1 else ''}{c.label} procs={p}")
                res["torch"][c.key][str(p)] = C.time_torch(c, p, cores, steps)
    else:
        res["torch"] = None

    for ex in EXECUTORS:
        res["planner" + SUFFIX[ex]] = planner_section(res, cfgs, SLOT[ex])

    if C.torch_available() and not quick:
        import paired

        res["paired_files"] = []
        for p in (2, 4):  # A-B-A re-check of target 3 with the best grid of this run
            meas = {(g, ex): v["step_s"] for ex in EXECUTORS
                    for g, v in res[SLOT[ex]]["weight"].items() if _procs(g) == p}
            best, ex = min(meas, key=meas.get)
            log(f"paired re-check, weight-dominated, P={p}, {best} ({ex})")
            pr = paired.main(["--procs", str(p), "--mlp", "weight", "--grid", best, "--save",
                              "--steps", str(steps), "--executor", ex])
            if pr.get("file"):
                res["paired_files"].append(pr["file"])

    for ex in (EXECUTORS if netcluster else ()):
        out = os.path.join(HERE, "results", f"netcluster{SUFFIX[ex]}.json")
        log(f"emulated cluster (benchmarks/netcluster.py, {ex})")
        cmd = [sys.executable, os.path.join(HERE, "netcluster.py"), "--workers", "4",
               "--rate", "1gbit", "--json", out, "--executor", ex] + (["--quick"] if quick else [])
        r = subprocess.run(cmd, text=True)
        key = "netcluster" + SUFFIX[ex]
        if r.returncode == 0 and os.path.exists(out):
            with open(out) as f:
                res[key] = json.load(f)
            res[key]["same_run"] = True
        else:
            res[key] = {"error": f"netcluster.py exited with {r.returncode}"}
    res["host"]["loadavg_end"] = os.getloadavg()
    return res


def _numpy_first_loss(c):
    X, y = C.make_data(c, 1)
    return C.NumpyMLP(c.widths, c.batch).step(X, y)


def planner_section(res, cfgs, slot="dask"):
    """The planner's grid (alpha, bandwidth measured on loopback) vs pure batch, measured
    (with the executor whose results are in ``res[slot]``)."""
    from dask_ipar.cost import Machine, mlp, plan

    lb = res.get("loopback", {})
    machine = Machine(alpha_s=lb.get("alpha_s", 5e-3), bandwidth_Bps=lb.get("bandwidth_Bps", 1e9),
                      flops_per_s=res["sgemm_gflops"] * 1e9 / max(1, res["cores"]))
    out = {"machine": {"alpha_s": machine.alpha_s, "bandwidth_Bps": machine.bandwidth_Bps}}
    for c in cfgs:
        for p in (2, 4):
            pl = plan(mlp(list(c.widths)), p, c.batch, machine)
            best = f"{pl.best.pr}x{pl.best.pc}"
            meas = res[slot][c.key]
            pred = {f"{g.pr}x{g.pc}": g.total_s for g in pl.grids if g.feasible}
            batch_g = f"1x{p}"
            out[f"{c.key}/{p}"] = {
                "planner_grid": best, "predicted_s": pred,
                "predicted_speedup": pred[batch_g] / pred[best],
                "measured_batch_s": meas[batch_g]["step_s"],
                "measured_planner_s": meas[best]["step_s"],
                "measured_speedup": meas[batch_g]["step_s"] / meas[best]["step_s"],
                "measured_best": min((g for g in meas if _procs(g) == p),
                                     key=lambda g: meas[g]["step_s"]),
            }
    return out


def executors(res) -> list[str]:
    """The executors a run measured (runs before the programs executor: graph only)."""
    return [ex for ex in EXECUTORS if res.get(SLOT[ex])]


def _exl(res, ex) -> str:
    """`` (executor)`` after a label, when the run measured more than one executor."""
    return f" ({ex})" if len(executors(res)) > 1 else ""


def _procs(g):
    a, b = g.split("x")
    return int(a) * int(b)


# ------------------------------------------------------------------- targets
def numpy_reference_s(res) -> float:
    """Target 1's NumPy step: the mean of the NumPy steps measured before and right after
    the 1x1 runs (runs before ``numpy_after_1x1`` existed: the one before)."""
    before = res["numpy"]["compute"]["step_s"]
    after = (res.get("numpy_after_1x1") or {}).get("step_s")
    return before if after is None else (before + after) / 2


def depth_fit(depth: list, what: str | None = None) -> tuple[float, float]:
    """Least-squares ``(per layer, fixed)`` of scheduler CPU + build per step (or of
    ``what``) against the number of layers."""
    fit = statistics.linear_regression(
        [r["layers"] for r in depth],
        [r[what] if what else r["sched_cpu_s"] + r["build_s"] for r in depth])
    return fit.slope, fit.intercept


def paired_files(res) -> list[str]:
    """The A-B-A re-check files made by this run: as recorded, or (runs saved before they
    were recorded) those made between the run's start and the time in its JSON's name."""
    import glob

    folder = os.path.join(HERE, "results")
    if "paired_files" in res:
        return [os.path.join(folder, f) for f in res["paired_files"]]
    name = res.get("json_name", "")
    stamp = name[len("run-"):-len(".json")].removeprefix("quick-")
    try:  # the runner names its JSON in UTC on these machines, as `when` is
        end = _dt.datetime.strptime(stamp, "%Y%m%dT%H%M%S").isoformat()
    except ValueError:
        end = "9999"
    out = []
    for f in sorted(glob.glob(os.path.join(folder, "paired-*.json"))):
        with open(f) as fh:
            when = json.load(fh).get("when", "")[:19]
        if res["when"][:19] <= when <= end:
            out.append(f)
    return out


def targets(res) -> list[dict]:
    out = []
    for ex in executors(res):
        _targets_1_2(res, ex, out)
    d = res["dask"]
    tr = res.get("torch") or {}
    if "weight" in d:
        for p in (2, 4):
            meas = {(g, ex): v["step_s"] for ex in executors(res)
                    for g, v in res[SLOT[ex]]["weight"].items() if _procs(g) == p}
            ddp = (tr.get("weight") or {}).get(str(p), {})
            if not meas:
                continue
            best, bex = min(meas, key=meas.get)
            if "step_s" not in ddp:
                out.append({"id": 3, "target": f"best dask-ipar grid / PyTorch DDP, weight-dominated, "
                            f"P={p}", "limit": "<= 1.00", "value": None, "ok": None,
                            "note": "torch not installed or DDP failed: " + str(ddp.get("error", ""))[:200]})
                continue
            r = meas[(best, bex)] / ddp["step_s"]
            out.append({"id": 3, "target": f"best dask-ipar grid ({best}{_exl(res, bex)}) / "
                        f"PyTorch DDP, weight-dominated, P={p}", "limit": "<= 1.00", "value": r,
                        "ok": r <= LIMITS["t3"]})
    for f in paired_files(res):
        with open(f) as fh:
            pr = json.load(fh)
        if "ratio_vs_mean_ddp" not in pr or bool(pr.get("quick", False)) != bool(res["quick"]):
            continue
        runs = ", ".join(f"{r['what']} {r['step_s']:.2f} s (load {r['load1']:.1f})" for r in pr["runs"])
        out.append({"id": "3 (paired)", "target": f"re-check, dask-ipar {pr['grid']}"
                    f"{_exl(res, pr.get('executor', 'graph'))} / mean PyTorch DDP, "
                    f"{pr['mlp']} MLP, P={pr['procs']}, A-B-A back to back: {runs}",
                    "limit": "<= 1.00", "value": pr["ratio_vs_mean_ddp"],
                    "ok": pr["ratio_vs_mean_ddp"] <= LIMITS["t3"],
                    "note": f"benchmarks/results/{os.path.basename(f)}"})
    nc = res.get("netcluster")
    for ex in executors(res):
        ncx = res.get("netcluster" + SUFFIX[ex])
        if not ncx or "targets" not in ncx:
            continue
        for t in ncx["targets"]:
            t = dict(t, id=4, target=t["target"] + _exl(res, ex))
            for v in ncx.get("grids", {}).values():
                ties = overlapping_grids(v)
                if "ranking" in t["target"] and f"({v['label']}:" in t["target"] and ties:
                    t["note"] = "timed steps overlap, not distinguishable in this run: " + \
                        ", ".join(f"{a} and {b}" for a, b in ties)
            out.append(t)
    if nc is None or "error" in (nc or {}):
        out.append({"id": 4, "target": "emulated 1 Gbit/s cluster (planner >= 1.5x pure batch; "
                    "ranking matches)", "limit": "see netcluster", "value": None, "ok": None,
                    "note": "not run in this run (needs root: --netcluster)"})
    for ex in executors(res):
        dx = res[SLOT[ex]]
        if "weight" in dx and "4x1" in dx["weight"] and "peak_rss_max" in dx["weight"]["4x1"]:
            a = dx["weight"]["4x1"]["peak_rss_max"]
            b = dx["weight"]["1x4"]["peak_rss_max"]
            out.append({"id": 5, "target": "peak RSS per worker, Pr=4 (4x1) / pure batch (1x4), "
                        f"weight-dominated{_exl(res, ex)}", "limit": f"<= {LIMITS['t5']:.2f}",
                        "value": a / b, "ok": a / b <= LIMITS["t5"]})
    return out


def _targets_1_2(res, ex, out):
    """Targets 1, 2 and 2b of executor ``ex``."""
    d, sfx, exl = res[SLOT[ex]], SUFFIX[ex], _exl(res, ex)
    if "compute" in d and "1x1" in d["compute"]:
        r = d["compute"]["1x1"]["step_s"] / numpy_reference_s(res)
        out.append({"id": 1, "target": f"dask-ipar 1x1{exl} step / NumPy step (compute-bound "
                    "MLP; NumPy: mean of the runs before and right after the 1x1 runs)",
                    "limit": f"<= {LIMITS['t1']:.2f}", "value": r, "ok": r <= LIMITS["t1"]})
        one = ((res.get("torch") or {}).get("compute") or {}).get("1")
        torch_s = one.get("step_s") if isinstance(one, dict) else None
        if torch_s:  # issue 23: against the faster of PyTorch (one process) and NumPy
            ref = min(torch_s, numpy_reference_s(res))
            r = d["compute"]["1x1"]["step_s"] / ref
            out.append({"id": "1 (23)", "target": f"dask-ipar 1x1{exl} step / the faster of "
                        f"PyTorch, one process ({torch_s:.3f} s), and NumPy "
                        f"({numpy_reference_s(res):.3f} s), compute-bound MLP, same run",
                        "limit": f"<= {LIMITS['t1_torch']:.2f}", "value": r,
                        "ok": r <= LIMITS["t1_torch"]})
    for key, label in (("compute", "compute-bound MLP"), ("tiny", "tiny MLP")):
        r = (res.get("own_scheduler" + sfx) or {}).get(key)
        if not r:
            continue
        L = len(r["widths"]) - 1
        ms = (r["build_s"] + r["sched_cpu_s"]) / L * 1e3
        out.append({"id": 2, "target": "scheduler CPU (its own process) + graph-build time per "
                    f"layer per step, 2x2 ({label}){exl}", "limit": f"<= {LIMITS['t2_ms']:.0f} ms",
                    "value": ms, "unit": "ms", "ok": ms <= LIMITS["t2_ms"]})
    depth = res.get("depth" + sfx) or []
    if len(depth) >= 2:
        per_layer, _ = depth_fit(depth)
        ms = per_layer * 1e3
        depths = ", ".join(str(r["layers"]) for r in depth)
        out.append({"id": 2, "target": "scheduler CPU (its own process) + graph-build time per "
                    f"added layer per step, 2x2 (tiny MLP at {depths} layers: least-squares "
                    f"slope){exl}", "limit": f"<= {LIMITS['t2_ms']:.0f} ms", "value": ms,
                    "unit": "ms", "ok": ms <= LIMITS["t2_ms"]})
    if res.get("tiny_2x2" + sfx):
        t = res["tiny_2x2" + sfx]
        L = len(t["widths"]) - 1
        ms = t["step_s"] / L * 1e3
        out.append({"id": "2b", "target": "extra, not one of the issue's targets: whole step "
                    "time per layer of a tiny MLP on 2x2 (compute ~0: all of it is overhead "
                    f"and hop latency){exl}",
                    "limit": f"<= {LIMITS['t2_ms']:.0f} ms", "value": ms, "unit": "ms",
                    "ok": ms <= LIMITS["t2_ms"]})


# ------------------------------------------------------------------ markdown
def fmt(x, nd=3):
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return "-"
    return f"{x:.{nd}f}"


def render(res) -> str:
    L = []
    w = L.append
    q = " (quick sizes)" if res["quick"] else ""
    w(f"# Benchmarks{q}\n")
    w(f"Generated by `python benchmarks/run.py{' --quick' if res['quick'] else ''}"
      f"{' --netcluster' if res.get('netcluster') else ''}` on {res['when']}. "
      f"Raw numbers: `benchmarks/results/{res['json_name']}`. Every number below was measured "
      "in that one run on this machine; nothing is copied from elsewhere.\n")
    h = res["host"]
    w("## Method\n")
    w(f"- Machine: {res['cores']} cores ({h['cpu']}), Python {h['python']}, NumPy {h['numpy']}, "
      f"dask {h['dask']}, distributed {h['distributed']}"
      + (f", PyTorch {h['torch']}" if h.get("torch") else ", PyTorch not installed") + ". "
      f"Load average at start {h['loadavg_start'][0]:.2f}, at end {h['loadavg_end'][0]:.2f} "
      "(the machine is shared; another process's load inflates every row alike only if it is "
      "steady, so compare rows of one run only).")
    # method 2: the warm-up waited for (runs from run-20261130T202221 on; the two before
    # method 2 was recorded are recognised by their re-measured NumPy step)
    new_method = res.get("method", 2 if "numpy_after_1x1" in res else 1) >= 2
    w(f"- Every step time is the median of {res['steps']} steps after one warm-up step"
      + (" (waited for until its new weights exist) and one untimed step. " if new_method
         else ". ") +
      "dask-ipar: `model.train_step` (graph build, batch placement, submission) plus "
      "`client.gather` of the loss statistics, so one step is fully finished before the next "
      "starts (no pipelining). The loss statistics depend on the forward pass only, so an "
      "interval ends when step k's forward is done and contains the rest of step k-1's "
      "backward and update (step k's forward needs step k-1's new weights): in steady state "
      "one interval is one whole step. "
      + ("Every timed step says another follows (`train_step(..., more=True)`, as `fit` "
         "within an epoch and as the predicted step), an untimed step after them takes "
         "their last pushed weights, the intervals run end to end (loss statistics back to "
         "loss statistics), and a step is the median of the means of two consecutive "
         "intervals (`common.pipelined_step`: single intervals of overlapping steps "
         "alternate about the step). " if res.get("method", 1) >= 4 else "")
      + "PyTorch: forward, backward, `optimizer.step()` between barriers on rank 0.")
    w("- FLOPs per step = 6 * B * sum(d_in * d_out); GFLOP/s = FLOPs / step time.")
    w("- dask-ipar: `LocalCluster` of worker processes, one dask thread per worker, BLAS threads "
      "per worker = max(1, cores / workers) (set through `distributed.nanny.pre-spawn-environ`): "
      + ", ".join(f"{p} worker(s): {t}" for p, t in res.get("threads", {}).items())
      + ". With 4 workers on 2 cores the processes share cores (oversubscribed), the same for "
      "PyTorch DDP with 4 processes.")
    w("- NumPy: one process, all cores, samples x features layout, preallocated buffers, every "
      "matmul one sgemm into `out=` (see `benchmarks/common.py: NumpyMLP`). Same init as "
      "dask-ipar (Glorot uniform, seed 0): first-step loss NumPy "
      + ", ".join(f"{res['numpy'][k]['first_loss']:.5f}" for k in res["numpy"])
      + ".")
    w("- Overhead profile: the step graph is built with `model.engine.train_step` (never "
      "submitted) to count tasks and the longest chains (tasks in sequence, and worker-to-worker "
      "hops in sequence); build time is that call plus `to_hlg` (median of "
      f"{14 if res.get('method', 0) >= 3 else 4} builds after a first one). "
      "Scheduler time = CPU time of the "
      "scheduler's event-loop thread across one step (`time.thread_time` via "
      "`client.run_on_scheduler`; with a LocalCluster that thread also serves the client's "
      "comms). Submit = wall time of `model.train_step` (build + batch placement + send).")
    w("- Peak memory: per-worker peak RSS (`VmHWM`, reset by writing 5 to "
      "`/proc/PID/clear_refs` after the warm-up step"
      + (" has finished" if new_method else "") +
      ", i.e. with weights and momentum already resident) over the "
      + ("untimed and timed steps" if new_method else "timed steps") +
      "; the largest worker is reported. The 4-worker cluster's "
      "workers are restarted (`client.restart()`) before each grid, so a grid's peak is not "
      "memory the allocator kept from the grids before it.\n")

    w(f"sgemm ceiling on this machine in this run: **{res['sgemm_gflops']:.1f} GFLOP/s** "
      "(all cores, float32).\n")

    for key, c in res["configs"].items():
        flops = c["flops"]
        w(f"## {c['label'].capitalize()} MLP: widths {'-'.join(map(str, c['widths']))}, "
          f"B={c['batch']} ({flops / 1e9:.1f} GFLOP per step, {c['params'] / 1e6:.1f} M parameters)\n")
        w("| implementation | procs | grid | step (s) | GFLOP/s | vs NumPy | load avg (1 min) at start |")
        w("|---|---|---|---|---|---|---|")
        npt = res["numpy"][key]["step_s"]
        w(f"| NumPy, one process | 1 | - | {fmt(npt)} | {flops / npt / 1e9:.1f} | 1.00 | "
          f"{fmt(res['numpy'][key].get('load1'), 1)} |")
        again = res.get("numpy_after_1x1") if key == "compute" else None
        if again:
            t = again["step_s"]
            w(f"| NumPy, one process, again right after the 1x1 runs | 1 | - | {fmt(t)} | "
              f"{flops / t / 1e9:.1f} | {t / npt:.2f} | {fmt(again.get('load1'), 1)} |")
        tr = (res.get("torch") or {}).get(key, {})
        rows = []
        for n, ex in enumerate(executors(res)):
            for g, r in res[SLOT[ex]][key].items():
                rows.append((_procs(g), 0, g, n, f"dask-ipar{_exl(res, ex)} | {_procs(g)} | {g}",
                             r["step_s"], r.get("load1")))
        for p, r in tr.items():
            name = "PyTorch, one process" if p == "1" else "PyTorch DDP (gloo)"
            if "step_s" in r:
                rows.append((int(p), 1, "-", 0, f"{name} | {p} | -", r["step_s"], r.get("load1")))
            else:
                w(f"| {name} | {p} | - | failed: {r.get('error', '')[:80]} | | | |")
        for *_, name, t, ld in sorted(rows):
            w(f"| {name} | {fmt(t)} | {flops / t / 1e9:.1f} | {t / npt:.2f} | {fmt(ld, 1)} |")
        if not tr:
            w("\nPyTorch rows skipped: torch is not installed.")
        w("")

    w("## Per-step overhead profile (dask-ipar)\n")
    if len(executors(res)) > 1:
        w("Executors (`Sequential.executor`, docs/concepts.md): *graph* submits every kernel as a "
          "dask task; *programs* submits one task per worker and step that runs the same "
          "kernels and pushes blocks to the other workers itself, plus one task per new weight "
          "block and loss statistic. For programs, tasks/step counts the scheduler's tasks and "
          "the graph build includes compiling the programs; the longest chain and the hops are "
          "those of the kernels' data flow, the same for both.\n")
    w("| MLP | executor | grid | tasks/step | tasks/layer | max tasks on a worker "
      "| longest chain (tasks) | hops in sequence / layer | graph build (ms) | submit (ms) "
      "| scheduler CPU (ms) | step (s) |")
    w("|---|---|---|---|---|---|---|---|---|---|---|---|")
    items = []
    for ex in executors(res):
        items += [(res["configs"][k]["label"], ex, g, r)
                  for k in res[SLOT[ex]] for g, r in res[SLOT[ex]][k].items()]
        t = res.get("tiny_2x2" + SUFFIX[ex])
        if t:
            items.append(("tiny " + "-".join(map(str, t["widths"])), ex, "2x2", t))
    for lab, ex, g, r in items:
        p = r["profile"]
        w(f"| {lab} | {ex} | {g} | {p['tasks']} | {p['tasks_per_layer']:.1f} | "
          f"{p['tasks_per_worker_max']} | {p['depth']} | {p['hops_per_layer']:.2f} | "
          f"{p['build_s'] * 1e3:.2f} | {r['submit_s'] * 1e3:.1f} | "
          f"{r['sched_cpu_s'] * 1e3:.1f} | {fmt(r['step_s'])} |")
    w("")

    own = {(k, ex): r for ex in executors(res)
           for k, r in (res.get("own_scheduler" + SUFFIX[ex]) or {}).items()}
    if own:
        w("### Scheduler in its own process (2x2)\n")
        w("In the LocalCluster rows above the scheduler's event loop also runs the client's "
          "comms (sending the batches and the graph), so its CPU time counts that data "
          "movement too. Here the scheduler is a subprocess of its own "
          "(`distributed.deploy.subprocess.SubprocessCluster`, as on a real cluster) and its "
          "whole-process CPU time is measured (psutil, mean over the steps); the graph build is "
          "the client's. This is what target 2 reads. The last two columns are dask's own "
          "cost for the same graph: every kernel replaced by a task that only receives its "
          "dependencies (`kernels.blocks.fetched`), inputs one-element placeholders "
          "(`common.noop_floor`).\n")
        w("| MLP | tasks/step | step (s) | scheduler CPU per step (ms) | per task (ms) "
          "| graph build (ms) | per layer: scheduler + build (ms) "
          "| no-op kernels: scheduler CPU per step (ms) | no-op kernels: step (s) |")
        w("|---|---|---|---|---|---|---|---|---|")
        for (k, ex), r in own.items():
            lab = (res["configs"][k]["label"] if k in res["configs"] else
                   "tiny " + "-".join(map(str, r["widths"]))) + _exl(res, ex)
            nl = len(r["widths"]) - 1
            noop = r.get("noop") or {}
            w(f"| {lab} | {r['tasks']} | {fmt(r['step_s'])} | {r['sched_cpu_s'] * 1e3:.1f} | "
              f"{r['sched_cpu_s'] / r['tasks'] * 1e3:.2f} | {r['build_s'] * 1e3:.2f} | "
              f"{(r['sched_cpu_s'] + r['build_s']) / nl * 1e3:.1f} | "
              + (f"{noop['sched_cpu_s'] * 1e3:.1f} | {fmt(noop['step_s'])} |" if noop
                 else "- | - |"))
        w("")

    for ex in executors(res):
        _render_depth(w, res.get("depth" + SUFFIX[ex]) or [], _exl(res, ex))

    for ex in executors(res):
        _render_memory(w, res[SLOT[ex]].get("weight", {}), _exl(res, ex))

    for ex in executors(res):
        _render_planner(w, res, res.get("planner" + SUFFIX[ex], {}), _exl(res, ex))

    for ex in executors(res):
        nc = res.get("netcluster" + SUFFIX[ex])
        if nc and "grids" in nc:
            w(render_netcluster(nc, _exl(res, ex)))

    w("## Targets (issue 6)\n")
    w("| # | target | limit | measured | result |")
    w("|---|---|---|---|---|")
    for t in res["targets"]:
        v = t["value"]
        val = "-" if v is None else (f"{v:.2f} {t.get('unit', 'x')}" if t.get("unit") else f"{v:.2f}x")
        okv = "not measured" if t["ok"] is None else verdict(t["ok"])
        note = f" ({t['note']})" if t.get("note") else ""
        w(f"| {t['id']} | {t['target']}{note} | {t['limit']} | {val} | {okv} |")
    w("")
    ana = os.path.join(HERE, "analysis.md")
    if os.path.exists(ana):
        with open(ana) as f:
            w(f.read())
    return "\n".join(L) + "\n"


def _render_depth(w, depth, exl):
    if len(depth) < 2:
        return
    w(f"### Per added layer and per step (tiny MLP, 2x2, scheduler in its own process){exl}\n")
    w("The tiny MLP (hidden widths 64, B=64) at several depths, 30 steps each: the "
      "least-squares slope over the depths splits the scheduler's CPU and the graph build "
      "into a cost per added layer and a fixed cost per step (loss, its statistics, "
      "inputs, the weight prefetch, the graph submission and the client's requests).\n")
    w("| layers | tasks/step | step (s) | scheduler CPU per step (ms) "
      "| graph build (ms) | scheduler + build per step (ms) |")
    w("|---|---|---|---|---|---|")
    for r in depth:
        w(f"| {r['layers']} | {r['tasks']} | {fmt(r['step_s'])} | "
          f"{r['sched_cpu_s'] * 1e3:.1f} | {r['build_s'] * 1e3:.2f} | "
          f"{(r['sched_cpu_s'] + r['build_s']) * 1e3:.1f} |")
    per_layer, fixed = depth_fit(depth)
    tasks_per_layer, _ = depth_fit(depth, "tasks")
    w(f"\nPer added layer: **{per_layer * 1e3:.1f} ms** ({tasks_per_layer:.0f} tasks); "
      f"fixed per step (the fit's intercept): {fixed * 1e3:.1f} ms.\n")


def _render_memory(w, wd, exl):
    mem = [(g, r) for g, r in wd.items() if "peak_rss_max" in r]
    if mem:
        w(f"## Peak memory per worker, weight-dominated MLP, 4 workers{exl}\n")
        w("| grid | peak RSS of the largest worker (MiB) | per worker (MiB) | vs pure batch |")
        w("|---|---|---|---|")
        base = wd["1x4"]["peak_rss_max"]
        for g, r in mem:
            per = ", ".join(f"{v / 2**20:.0f}" for _, v in sorted(r["peak_rss"].items()))
            w(f"| {g} | {r['peak_rss_max'] / 2**20:.0f} | {per} | {r['peak_rss_max'] / base:.2f} |")
        w("")


def _render_planner(w, res, pl, exl):
    if pl:
        m = pl["machine"]
        w(f"## Planner's grid vs pure batch (this machine, loopback){exl}\n")
        w(f"Planner machine: alpha = {m['alpha_s'] * 1e3:.1f} ms (a 4-byte worker-to-worker "
          f"transfer), bandwidth = {m['bandwidth_Bps'] / 1e6:.0f} MB/s (a 64 MiB transfer), "
          "both measured in this run between two workers.\n")
        w("| MLP | P | planner's grid | predicted speedup vs 1xP | measured pure batch (s) "
          "| measured planner's grid (s) | measured speedup | measured best grid |")
        w("|---|---|---|---|---|---|---|---|")
        for k, v in pl.items():
            if k == "machine":
                continue
            key, p = k.split("/")
            w(f"| {res['configs'][key]['label']} | {p} | {v['planner_grid']} | "
              f"{v['predicted_speedup']:.2f} | {fmt(v['measured_batch_s'])} | "
              f"{fmt(v['measured_planner_s'])} | {v['measured_speedup']:.2f} | {v['measured_best']} |")
        w("")


def overlapping_grids(v) -> list[tuple[str, str]]:
    """Neighbours in the measured order of an emulated-cluster MLP whose timed steps overlap
    (the slower grid's fastest step is faster than the faster grid's slowest one)."""
    by, om = v["by_grid"], v["order_measured"]
    return [(a, b) for a, b in zip(om, om[1:])
            if min(by[b]["steps_s"]) <= max(by[a]["steps_s"])]


def render_netcluster(nc, exl="") -> str:
    L = []
    w = L.append
    w(f"## Emulated multi-host cluster ({nc['workers']} workers, {nc['rate']} per link){exl}\n")
    w(f"Each worker and the scheduler in its own network namespace, one bridge, `tc tbf` "
      f"{nc['rate']} on both directions of every worker and scheduler link (the client's "
      f"link: {nc.get('client_rate') or 'not limited; it only sends batches'}). "
      f"BLAS threads per worker: {nc.get('threads')}. Link check: a 64 MiB worker-to-worker "
      f"transfer took {nc['link']['t_64MiB_s']:.3f} s, i.e. **{nc['link']['bandwidth_Bps'] * 8 / 1e9:.3f} "
      f"Gbit/s** achieved (4-byte transfer {nc['link']['t_4B_s'] * 1e3:.1f} ms, used as alpha). "
      f"Steps: median of {nc['steps']} after one warm-up.\n")
    for key, v in nc["grids"].items():
        w(f"### {v['label']} MLP: widths {'-'.join(map(str, v['widths']))}, B={v['batch']}\n")
        stepped = any("pred_step_s" in r for r in v["by_grid"].values())  # else older runs
        w("| grid | measured step (s) | timed steps, fastest-slowest (s) | predicted comm (s) "
          f"| predicted {'step' if stepped else 'total'} (s) | measured rank | predicted rank |")
        w("|---|---|---|---|---|---|---|")
        for g in v["order_measured"]:
            r = v["by_grid"][g]
            w(f"| {g} | {fmt(r['step_s'])} | {fmt(min(r['steps_s']))}-{fmt(max(r['steps_s']))} | "
              f"{fmt(r['pred_comm_s'])} | {fmt(r.get('pred_step_s', r.get('pred_total_s')))} | "
              f"{v['order_measured'].index(g) + 1} | {v['order_predicted'].index(g) + 1} |")
        ties = overlapping_grids(v)
        w(f"\nPlanner's grid {v['planner_grid']}: {v['speedup_vs_batch']:.2f}x faster than pure "
          f"batch (measured); ranking {'matches' if v['ranking_matches'] else 'does NOT match'} "
          "the prediction."
          + (" Timed steps that overlap (not distinguishable in this run): "
             + ", ".join(f"{a} and {b}" for a, b in ties) + "." if ties else "") + "\n")
    return "\n".join(L)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, about a minute")
    ap.add_argument("--out", default=os.path.join(C.ROOT, "docs", "benchmarks.md"))
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--netcluster", action="store_true",
                    help="also run the emulated 1 Gbit/s cluster (needs root)")
    ap.add_argument("--from-json", help="re-render a saved JSON instead of measuring")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("distributed").setLevel(logging.ERROR)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    if a.from_json:
        with open(a.from_json) as f:
            res = json.load(f)
        res["targets"] = targets(res)
    else:
        res = measure(a.quick, a.cores, a.netcluster)
        res["targets"] = targets(res)
        name = f"run-{'quick-' if a.quick else ''}{time.strftime('%Y%m%dT%H%M%S')}.json"
        res["json_name"] = name
        with open(os.path.join(HERE, "results", name), "w") as f:
            json.dump(res, f, indent=1, default=str)
        log(f"raw numbers: benchmarks/results/{name}")
    md = render(res)
    md += kept_sections(a.out)  # sections other scripts own (benchmarks/data_bench.py)
    with open(a.out, "w") as f:
        f.write(md)
    log(f"wrote {a.out}")
    for t in res["targets"]:
        v = t["value"]
        print(f"  target {t['id']}: {t['target']}: "
              f"{'-' if v is None else round(v, 3)} ({t['limit']}) -> "
              f"{'not measured' if t['ok'] is None else verdict(t['ok'])}")


if __name__ == "__main__":
    main()
