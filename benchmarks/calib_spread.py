"""How far ``dask-ipar calibrate`` moves between runs on one emulated cluster (issue 23).

    sudo python benchmarks/calib_spread.py [--run 8x1gbit] [--rounds 3] [--json out.json]
        [--resim benchmarks/results/peers-A.json,...] [--rate-groups 1,3]

The step-time model's predictions are only as steady as the machine they are made on. This
builds one emulated cluster (:mod:`netcluster`, P hosts behind ``tc tbf`` links of RATE),
then ``--rounds`` times, back to back, measures the machine the peer sweep predicts with
(:func:`netcluster.link_check` and :func:`netcluster.step_machine`: the link checks and
``dask-ipar calibrate``). Prints per figure of the machine its median and its spread (the
largest over the smallest reading).

``--resim``: saved peer sweeps (``peers-*.json``) whose runs have this ``--run``'s P and
rate; each of their grids' measured steps is predicted again on every round's machine
(``rank_grids``, as the sweep did), so the spread of the predicted / measured ratios that
the calibration alone causes shows beside the sweep's own ratio.

``--rate-groups 1,3``: the rounds alternate between these values of the calibration's
``Effort.rate_groups`` (1: the compute rates' readings back to back, near what calibrate
did before session 59, which took one worker's second reading later and the mix after the
memory rate; 3: spread over the calibration), and the spread table is printed for each
value's rounds too, so the two ways are compared on one cluster at one time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402
import netcluster as N  # noqa: E402

#: the figures of the machine the step-time model reads (the rest are fixed or unused)
FIGURES = ("bandwidth_Bps", "flops_per_s", "cluster_flops_per_s", "task_s", "mem_Bps",
           "message_s", "round_s", "transfer_cpu_s_per_B", "elementwise_Bps", "exchange_Bps",
           "busy_exchange_Bps", "loaded_message_s", "direct_message_cpu_s", "message_cpu_s",
           "step_cpu_s", "background_cores", "elementwise_large_Bps", "gemm_edge_flops",
           "program_task_cpu_s", "conv_Bps", "stack_cpu_s_per_B")


def spread_table(machines: list[dict]) -> list[str]:
    """Markdown rows: per figure, the median and the largest over the smallest reading."""
    rows = ["| figure | " + " | ".join(f"round {k + 1}" for k in range(len(machines)))
            + " | max / min |", "|---|" + "---|" * (len(machines) + 1)]
    for f in FIGURES:
        vals = [m.get(f) for m in machines]
        if any(v is None for v in vals):
            continue
        lo, hi = min(vals), max(vals)
        rows.append(f"| {f} | " + " | ".join(f"{v:.4g}" for v in vals)
                    + f" | {hi / lo if lo > 0 else float('nan'):.2f} |")
    return rows


def resim(sweeps: list[str], workers: int, rate: str, machines: list[dict],
          cores: int) -> list[dict]:
    """Per grid of the sweeps' matching runs: its measured step, the sweep's own predicted
    / measured ratio and the ratio on each round's machine."""
    from dask_ipar.cost import Machine
    from dask_ipar.runtime.gridrank import rank_grids

    cfgs = C.sweep_models()
    out = []
    for path in sweeps:
        res = json.load(open(path))
        for run in res["results"]:
            if run["workers"] != workers or run["rate"] != rate:
                continue
            for key, entry in run["grids"].items():
                cfg = cfgs[key]
                shape = cfg.image if isinstance(cfg, C.CNNConfig) else (cfg.widths[0],)
                sims = []
                for m in machines:
                    ranked = rank_grids(cfg.layers(), shape, workers, cfg.batch, Machine(**m),
                                        cores=cores, executor=run.get("executor", "programs"))
                    sims.append({str(c.grid): c.seconds for c in ranked})
                for g, v in entry["by_grid"].items():
                    if v.get("step_s") is None:
                        continue
                    out.append({"sweep": os.path.basename(path), "model": key, "grid": g,
                                "step_s": v["step_s"],
                                "sweep_ratio": (v["pred_step_s"] / v["step_s"]
                                                if v.get("pred_step_s") else None),
                                "ratios": [s[g] / v["step_s"] if g in s else None
                                           for s in sims]})
    return out


def resim_table(rows: list[dict], rounds: int) -> list[str]:
    L = ["| sweep | model | grid | measured (s) | sweep's ratio | "
         + " | ".join(f"round {k + 1}" for k in range(rounds)) + " | spread |",
         "|---|---|---|---|---|" + "---|" * (rounds + 1)]
    within = [0] * rounds
    for r in rows:
        rs = [q for q in r["ratios"] if q is not None]
        for k, q in enumerate(r["ratios"]):
            within[k] += q is not None and abs(q - 1) <= 0.15
        L.append(f"| {r['sweep']} | {r['model']} | {r['grid']} | {r['step_s']:.3f} | "
                 + ("-" if r["sweep_ratio"] is None else f"{r['sweep_ratio']:.2f}") + " | "
                 + " | ".join("-" if q is None else f"{q:.2f}" for q in r["ratios"])
                 + (f" | {max(rs) - min(rs):.2f} |" if rs else " | - |"))
    L.append("")
    L.append(f"Within 15% on each round's machine: {', '.join(map(str, within))} of "
             f"{len(rows)}.")
    return L


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="8x1gbit", help="PxRATE of the emulated cluster")
    ap.add_argument("--rounds", type=int, default=3, help="calibrations, back to back (>= 2)")
    ap.add_argument("--resim", default="", help="peer sweep JSON files, comma separated")
    ap.add_argument("--json", default=None, help="write the machines and ratios here")
    ap.add_argument("--rate-groups", default="",
                    help="comma-separated group counts for the compute rates' readings, "
                         "alternated round by round (e.g. 1,3); default: the calibration's")
    a = ap.parse_args(argv)
    if a.rounds < 2:
        ap.error(f"--rounds {a.rounds}: a spread needs at least 2 rounds")
    try:
        groups = [int(g) for g in a.rate_groups.split(",") if g.strip()]
    except ValueError:
        groups = [0]
    if any(g < 1 for g in groups):
        ap.error(f"--rate-groups {a.rate_groups!r}: expected whole numbers of 1 or more, "
                 "comma separated, e.g. 1,3")
    if groups and a.rounds < 2 * len(groups):
        ap.error(f"--rounds {a.rounds} with --rate-groups {a.rate_groups}: at least two "
                 f"rounds per value ({2 * len(groups)}) for a spread of each")
    try:
        p, rate = a.run.lower().split("x", 1)
        workers = int(p)
        N.parse_rate_Bps(rate)
    except ValueError:
        ap.error(f"--run {a.run!r}: expected PxRATE, e.g. 8x1gbit or 4x10gbit")
    sweeps = [s for s in a.resim.split(",") if s]
    for s in sweeps:
        if not os.path.exists(s):
            ap.error(f"--resim: no file {s}")
    from distributed import Client

    machines, links = [], []
    with N.emulated_cluster(workers, rate) as addr, Client(addr) as client:
        for k in range(a.rounds):
            t = time.perf_counter()
            link = N.link_check(client, rate)
            effort = {"rate_groups": groups[k % len(groups)]} if groups else {}
            m = N.step_machine(client, link, log=False, **effort)
            machines.append(dataclasses.asdict(m))
            links.append(link)
            print(f"round {k + 1}: calibrated in {time.perf_counter() - t:.0f} s"
                  + (f" (rate groups {effort['rate_groups']})" if effort else ""), flush=True)
    print("\n".join(spread_table(machines)))
    for j, g in enumerate(groups):
        print(f"\nThe rounds with the compute rates' readings in {g} group(s):")
        print("\n".join(spread_table(machines[j::len(groups)])))
    rows = resim(sweeps, workers, rate, machines, os.cpu_count()) if sweeps else []
    if rows:
        print()
        print("\n".join(resim_table(rows, a.rounds)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"run": a.run, "rate_groups": [groups[k % len(groups)] if groups
                                                    else None for k in range(a.rounds)],
                       "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       "machines": machines, "links": links, "resim": rows,
                       "median": {f: statistics.median(m[f] for m in machines)
                                  for f in FIGURES if all(m.get(f) is not None
                                                          for m in machines)}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
