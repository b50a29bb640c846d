"""dask-ipar on one worker (grid 1x1) against PyTorch and NumPy in one process (issue 23).

    python benchmarks/one_process.py [--mlps compute,weight] [--rounds 3] [--steps 5]
        [--variants auto,numpy-1t] [--data file] [--json out.json]

The issue's target: the compute-bound MLP's 1x1 step at most 1.05x the faster of PyTorch
(one process) and the NumPy reference, in the same run. Each round runs, back to back, the
NumPy reference (``common.NumpyMLP``: one process, preallocated buffers, every matmul one
sgemm), dask-ipar on 1x1 (a LocalCluster of one worker process with all the machine's BLAS
threads; the programs executor, momentum SGD; ``common.time_dask_grid``) and PyTorch in one
process (``torch_ddp.py --procs 1``, all cores); each figure the median of ``--steps``
steps after a warm-up. dask-ipar's batches come from where ``--data`` says
(``common.DATA_PATHS``): by default a ``.npy`` file the worker reads (the peers draw theirs
in their own memory), or the client's memory, sent every step (``client``, as before
2026-12-06). The verdict compares the medians over the rounds, so that a phase
of this shared machine's speed moves all three alike. With ``--variants`` dask-ipar runs
once per setting each round (the worker's ``matmul`` setting, and ``-1t`` for element-wise
passes on one thread): the first variant is the verdict's, the others are reported beside.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

LIMIT = 1.05  # dask-ipar 1x1 / the faster of PyTorch and NumPy


#: ``--variants``: the worker's ``ipar.matmul`` and whether its element-wise passes use its
#: threads (``-1t``: the worker's ``OMP_NUM_THREADS`` set to 1 after it started, which only
#: ``kernels.threads.kernel_threads`` reads then: the BLAS keep their threads).
VARIANTS = ("auto", "numpy", "torch", "auto-1t", "numpy-1t", "torch-1t")


def _set_variant(client, variant: str, cores: int) -> None:
    def setup(matmul, threads):
        import os

        import dask

        dask.config.set({"ipar.matmul": matmul})
        os.environ["OMP_NUM_THREADS"] = str(threads)

    matmul, _, one = variant.partition("-")
    client.run(setup, matmul, 1 if one else cores)


def measure(cfg, client, rounds: int, steps: int, cores: int, log=print,
            variants=("auto",), data: str = "file") -> dict:
    """Interleaved rounds of NumPy, dask-ipar 1x1 (each of ``variants``) and PyTorch on
    ``cfg``; step seconds. The first variant is ``dask``, the others ``dask:<variant>``."""
    import common as C

    keys = ["dask"] + [f"dask:{v}" for v in variants[1:]]
    out: dict = {"numpy": [], **{k: [] for k in keys}, "torch": []}
    for r in range(rounds):
        out["numpy"].append(C.time_numpy(cfg, steps)["step_s"])
        for key, variant in zip(keys, variants):
            _set_variant(client, variant, cores)
            out[key].append(C.time_dask_grid(client, cfg, "1x1", steps, warmup=1,
                                             profile=False, executor="programs",
                                             data=data)["step_s"])
        t = C.time_torch(cfg, 1, cores, steps)
        out["torch"].append(t.get("step_s"))
        if "error" in t:
            log(f"PyTorch failed: {t['error']}")
        log(f"{cfg.label}, round {r + 1}: " + ", ".join(
            f"{k} {v[-1]:.3f} s" if v[-1] is not None else f"{k} -" for k, v in out.items()))
    return out


def summarize(times: dict) -> dict:
    med = {k: statistics.median(v) for k, v in times.items() if v and None not in v}
    peers = [med[k] for k in ("numpy", "torch") if k in med]
    ratio = med["dask"] / min(peers) if "dask" in med and peers else None
    return {"median_s": med, "ratio": ratio,
            "ok": None if ratio is None else ratio <= LIMIT}


def _cell(times: list, median: float | None) -> str:
    if not times or None in times or median is None:
        return "-"
    return f"{median:.3f} ({', '.join(f'{x:.3f}' for x in times)})"


def _json_where(name: str) -> str:
    """Where the raw numbers are: a bare file name lies in ``benchmarks/results``."""
    return name if os.sep in name else f"benchmarks/results/{name}"


def _variants_flag(res: dict) -> str:
    v = res.get("variants") or ["auto"]
    data = res.get("data", "client")  # runs before the flag: from the client
    return ("" if v == ["auto"] else f" --variants {','.join(v)}") + (
        "" if data == "file" else f" --data {data}")


def render(res: dict) -> str:
    head = (f"`python benchmarks/one_process.py --rounds {res['rounds']} --steps "
            f"{res['steps']}{_variants_flag(res)}` on {res['when']} ({res['cores']} cores; raw numbers in "
            f"`{_json_where(res['json_name'])}`): step seconds, per round NumPy / "
            "dask-ipar 1x1 / PyTorch, back to back; the verdict from the medians over the "
            "rounds.")
    cols = ("| MLP | NumPy (s) | dask-ipar 1x1 (s) | PyTorch, one process (s) | 1x1 / faster "
            "peer | limit | verdict |")
    L = [head, "", cols, "|---|---|---|---|---|---|---|"]
    for key, r in res["mlps"].items():
        t, s = r["steps_s"], r["summary"]
        cells = [_cell(t[k], s["median_s"].get(k)) for k in ("numpy", "dask", "torch")]
        ratio = s["ratio"]
        if key != "compute":  # the issue sets its limit on the compute-bound MLP only
            limit, verdict = "-", "not a target"
        else:
            limit = f"<= {LIMIT:.2f}"
            verdict = "-" if ratio is None else ("PASS" if s["ok"] else "MISS")
        L.append(f"| {r['label']} | {' | '.join(cells)} | "
                 f"{'-' if ratio is None else f'{ratio:.2f}'} | {limit} | {verdict} |")
    variants = res.get("variants") or ["auto"]
    if len(variants) > 1:
        L += ["", f"dask-ipar 1x1 with each of `--variants {','.join(variants)}` (the first is "
              "the table's), median (rounds) and / the faster peer:", ""]
        for key, r in res["mlps"].items():
            t, s = r["steps_s"], r["summary"]
            peer = min(s["median_s"][k] for k in ("numpy", "torch") if k in s["median_s"])
            for k, v in zip(["dask"] + [f"dask:{v}" for v in variants[1:]], variants):
                med = statistics.median(t[k])
                L.append(f"- {r['label']}, {v}: {_cell(t[k], med)} s, {med / peer:.2f}")
    return "\n".join(L)


def main(argv=None):
    import common as C

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mlps", default="compute", help="comma-separated: compute, weight")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--variants", default="auto",
                   help="comma-separated dask-ipar settings timed in turn each round, the "
                        "first the verdict's: " + ", ".join(VARIANTS) + " (matmul setting; "
                        "-1t: element-wise passes on one thread)")
    p.add_argument("--data", default="file", choices=C.DATA_PATHS,
                   help="where dask-ipar's batches come from: a .npy file the worker reads "
                   "(default) or the client, sent every step")
    p.add_argument("--json", default=None, help="where to write the raw numbers (default: "
                   "benchmarks/results/one-<time>.json)")
    a = p.parse_args(argv)
    cfgs = {c.key: c for c in C.configs(False)}
    keys = [k.strip() for k in a.mlps.split(",") if k.strip()]
    bad = [k for k in keys if k not in cfgs]
    if bad:
        p.error(f"--mlps: unknown {', '.join(bad)}; choose from {', '.join(cfgs)}")
    variants = tuple(v.strip() for v in a.variants.split(",") if v.strip())
    if not variants or any(v not in VARIANTS for v in variants):
        p.error(f"--variants: expected some of {', '.join(VARIANTS)}, got {a.variants!r}")
    if a.rounds < 1 or a.steps < 1:
        p.error("--rounds and --steps must be at least 1")
    cores = os.cpu_count() or 1
    stamp = time.strftime("%Y%m%dT%H%M%S")
    path = a.json or os.path.join(HERE, "results", f"one-{stamp}.json")
    res = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cores": cores, "rounds": a.rounds,
           "steps": a.steps, "variants": list(variants), "data": a.data,
           "json_name": os.path.basename(path) if a.json is None else a.json, "mlps": {}}
    cluster, client, _ = C.local_cluster(1, cores)
    try:
        for k in keys:
            t = measure(cfgs[k], client, a.rounds, a.steps, cores,
                        log=lambda m: print(m, file=sys.stderr, flush=True), variants=variants,
                        data=a.data)
            res["mlps"][k] = {"label": cfgs[k].label, "describe": cfgs[k].describe(),
                              "steps_s": t, "summary": summarize(t)}
    finally:
        client.close()
        cluster.close()
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(render(res))


if __name__ == "__main__":
    main()
