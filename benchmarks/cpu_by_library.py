"""Where the machine's CPU goes during training steps: dask-ipar's workers beside PyTorch's
tensor-parallel ranks, by library and by thread, from a system-wide ``perf`` profile
(issue 23).

    python benchmarks/cpu_by_library.py [--model compute] [--workers 8] [--grid 8x1]
        [--seconds 15] [--json out.json]

Needs Linux ``perf`` (Debian: ``apt-get install linux-perf``) and the right to profile
every process (root, or ``/proc/sys/kernel/perf_event_paranoid`` at -1). On this machine's
loopback, one after the other:

* dask-ipar: a LocalCluster of ``--workers`` one-thread workers (``common.local_cluster``),
  ``--model`` on ``--grid`` (worker programs), steps in a loop; after the warm-up, ``perf
  record -a`` samples every CPU at 199 Hz for ``--seconds``;
* PyTorch: as many tensor-parallel ranks (``peers.py --mode tp --mesh <workers>x1``,
  gloo, one thread each) stepping the same model, sampled the same way.

Each sample is charged to its shared object and symbol (``perf report --sort pid,dso,sym``):
the BLAS (PyTorch's MKL, which both run on Intel CPUs, where dask-ipar's ``matmul: auto``
sends its NumPy blocks' products through it; NumPy's OpenBLAS, dask-ipar's elsewhere),
PyTorch's other kernels, the Python interpreter, NumPy's ufuncs, libc (copies, memset), the
kernel (TCP copies, scheduling, page faults). dask-ipar's samples are also charged to the
thread that took them, by its Python name (program threads, the workers' event loops, the
direct links' reading and writing threads, the client's and scheduler's). The shares are
of all the machine's samples, idle included (a loaded machine has few).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

#: How a sample is reported: the first ``(name, shared object, symbol)`` patterns it matches.
LIBRARIES = (
    ("BLAS (MKL's sgemm and packing)", r"libtorch_cpu|libmkl", r"^mkl_"),
    ("BLAS (OpenBLAS)", r"openblas", r""),
    ("PyTorch's other kernels (element-wise, gloo)", r"libtorch|libc10", r""),
    ("Python interpreter", r"libpython|^python", r""),
    ("NumPy", r"_multiarray_umath", r""),
    ("libc (copies, memset)", r"libc\.so|libc-", r""),
    ("kernel (TCP copies, scheduling, page faults)", r"kernel|vmlinux", r""),
)


def library_of(dso: str, sym: str = "") -> str:
    for name, lib, symbol in LIBRARIES:
        if re.search(lib, dso) and re.search(symbol, sym):
            return name
    return "other"


def role_of(name) -> str:
    """A dask-ipar thread's role by its Python name (None: a thread of its processes that
    Python did not start, e.g. a BLAS thread)."""
    if name is None:
        return "native threads (BLAS, other)"
    if name.startswith("client:"):
        return "client and scheduler"
    if "Dask-Default-Threads" in name:
        return "program threads"
    if name == "MainThread":
        return "workers' event loops"
    if "ipar-wire" in name and name.endswith("-read"):
        return "direct links, reading"
    if "ipar-wire" in name and "-to-" in name:
        return "direct links, writing"
    return "other threads"


def _perf_record(seconds: float, path: str, failed: list | None = None) -> None:
    """``perf record -a`` for ``seconds`` into ``path``; its error, where it fails, into
    ``failed`` (a thread's), else raised."""
    r = subprocess.run(["perf", "record", "-a", "-F", "199", "-o", path, "--", "sleep",
                        str(seconds)], capture_output=True, text=True)
    if r.returncode:
        err = RuntimeError(f"perf record failed ({r.stderr.strip()[-500:]}); run as root, or "
                           "set /proc/sys/kernel/perf_event_paranoid to -1")
        if failed is None:
            raise err
        failed.append(err)


def shares(path: str, names: dict | None = None, tids=()) -> dict:
    """``{"by_library": {...}, "by_role": {role: {library: share}}}`` of a ``perf`` data
    file, shares of all its samples (``idle``: the idle task's); ``names``: thread id ->
    Python thread name of dask-ipar's processes, ``tids`` all their threads (those
    without a name are native ones; threads of other processes are ``other processes``)."""
    out = subprocess.run(["perf", "report", "-i", path, "--stdio", "--no-children", "--sort",
                          "pid,dso,sym"], check=True, capture_output=True, text=True).stdout
    lib: dict = collections.Counter()
    role: dict = collections.defaultdict(collections.Counter)
    for line in out.splitlines():
        m = re.match(r"\s+([\d.]+)%\s+(\d+):(.+?)\s{2,}(\S+)\s+\[.\]\s+(\S+)", line)
        if not m:
            continue
        share, tid = float(m.group(1)) / 100, int(m.group(2))
        where = "idle" if tid == 0 else library_of(m.group(4), m.group(5))
        lib[where] += share
        if names is not None:
            role["other processes" if tid not in names and tid not in tids
                 else role_of(names.get(tid))][where] += share
    if sum(lib.values()) < 0.95:
        print(f"warning: only {sum(lib.values()):.0%} of {path}'s samples were read",
              file=sys.stderr)
    return {"by_library": dict(lib), "by_role": {k: dict(v) for k, v in role.items()}}


def _names():
    return {t.native_id: t.name for t in threading.enumerate()}


def profile_dask(cfg, workers: int, grid: str, seconds: float, path: str) -> dict:
    """dask-ipar's steps in a loop, ``perf`` over ``seconds`` of them."""
    import common as C
    from dask_ipar import SGD

    cluster, client, _ = C.local_cluster(workers, os.cpu_count() or 1)
    model = None
    try:
        opt = SGD(lr=0.01, momentum=0.9)
        model = cfg.build_model()
        with C.step_batches(cfg, model, "file") as batches:
            model.distribute(client, grid)
            model.executor = "programs"
            for k in range(3):
                client.gather(model.train_step(*batches[k % 2], opt, more=True))
            names = {}
            for got in client.run(_names).values():
                names.update(got)
            names.update({t: f"client:{n}" for t, n in _names().items()})
            pids = {os.getpid(), *client.run(os.getpid).values()}
            # every thread of these processes, BLAS ones included (all started by now)
            tids = {int(t) for p in pids for t in os.listdir(f"/proc/{p}/task")}
            failed: list = []
            rec = threading.Thread(target=_perf_record, args=(seconds, path, failed))
            t0, steps = time.perf_counter(), 0
            rec.start()
            while rec.is_alive():
                client.gather(model.train_step(*batches[steps % 2], opt, more=True))
                steps += 1
            wall = time.perf_counter() - t0
            client.gather(model.train_step(*batches[0], opt, more=False))
            if failed:
                raise failed[0]
    finally:
        if model is not None:
            model.close()
        client.close()
        cluster.close()
    return {**shares(path, names, tids), "step_s": wall / max(1, steps), "steps": steps}


def profile_tp(cfg, workers: int, seconds: float, path: str) -> dict:
    """PyTorch's tensor-parallel ranks on loopback, ``perf`` over ``seconds`` of steps."""
    steps = 200  # more than ``seconds`` hold; the ranks are stopped after the profile
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    master = f"127.0.0.1:{29600 + int(time.time()) % 300}"
    args = [sys.executable, os.path.join(HERE, "peers.py"), "--mode", "tp", "--mesh",
            f"{workers}x1", "--world", str(workers), "--master", master, "--spec",
            json.dumps(cfg.spec()), "--batch", str(cfg.batch), "--steps", str(steps)]
    with tempfile.TemporaryFile(mode="w+") as errs:
        procs = [subprocess.Popen([*args, "--rank", str(r)], env=env, stdout=subprocess.DEVNULL,
                                  stderr=errs, start_new_session=True)
                 for r in range(workers)]
        try:
            time.sleep(20.0)  # started, built, and past the warm-up step
            _perf_record(seconds, path)
            ended = [r for r, p in enumerate(procs) if p.poll() is not None]
            if ended:  # the profile is not of their steps
                errs.seek(0)
                raise RuntimeError(f"tensor-parallel ranks {ended} ended before the profile "
                                   f"did: {errs.read()[-1000:]}")
        finally:
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
    return shares(path)


def render(res: dict) -> str:
    d, t = res["dask"], res["tp"]
    lines = [f"`python benchmarks/cpu_by_library.py --model {res['model']} --workers "
             f"{res['workers']} --grid {res['grid']} --seconds {res['seconds']:g}` on "
             f"{res['when']} ({res['cores']} cores, loopback; raw numbers in `{res['json']}`); "
             f"dask-ipar's step {d['step_s']:.3f} s over {d['steps']} steps. Shares of the "
             "machine's CPU samples:", "",
             "| library | dask-ipar | tensor parallel |", "|---|---|---|"]
    libs = sorted(set(d["by_library"]) | set(t["by_library"]),
                  key=lambda k: -d["by_library"].get(k, 0.0))
    for k in libs:
        lines.append(f"| {k} | {100 * d['by_library'].get(k, 0.0):.1f}% | "
                     f"{100 * t['by_library'].get(k, 0.0):.1f}% |")
    lines += ["", "dask-ipar's by thread (the Python interpreter's share beside):", "",
              "| threads | all | Python interpreter |", "|---|---|---|"]
    for role, by in sorted(d["by_role"].items(), key=lambda kv: -sum(kv[1].values())):
        lines.append(f"| {role} | {100 * sum(by.values()):.1f}% | "
                     f"{100 * by.get('Python interpreter', 0.0):.1f}% |")
    return "\n".join(lines)


def main(argv=None):
    import common as C

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="compute", choices=["compute", "weight"])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--grid", default=None, help="dask-ipar's grid (default: <workers>x1)")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--json", default=None, help="where to write the raw numbers (default: "
                   "benchmarks/results/cpu-lib-<time>.json)")
    a = p.parse_args(argv)
    if shutil.which("perf") is None:
        p.error("perf is not installed: apt-get install linux-perf (Debian), then run as root")
    grid = a.grid or f"{a.workers}x1"
    cfg = C.sweep_models()[a.model]
    path = a.json or os.path.join(HERE, "results",
                                  f"cpu-lib-{time.strftime('%Y%m%dT%H%M%S')}.json")
    res = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cores": os.cpu_count(),
           "model": a.model, "workers": a.workers, "grid": grid, "seconds": a.seconds,
           "json": path if a.json else f"benchmarks/results/{os.path.basename(path)}"}
    with tempfile.TemporaryDirectory() as tmp:
        res["dask"] = profile_dask(cfg, a.workers, grid, a.seconds, os.path.join(tmp, "d"))
        res["tp"] = profile_tp(cfg, a.workers, a.seconds, os.path.join(tmp, "t"))
    C.write_json(path, res)
    print(render(res))


if __name__ == "__main__":
    main()
