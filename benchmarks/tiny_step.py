"""The fixed cost of a training step (issue 23): the tiny MLP on 2x2, steps per program.

    python benchmarks/tiny_step.py [--ks 1,4,8,16] [--rounds 3] [--epochs 4]
        [--optimizer sgd|adam] [--json out.json]

The tiny MLP (64-64-64-64-10, B=64: compute near zero, so its step is all overhead and
hop latency) trained with ``fit`` on 2x2 (a LocalCluster of 4 worker processes, 1 thread
each; momentum SGD, or Adam with ``--optimizer adam``), ``steps_per_program`` k side by
side, interleaved over ``--rounds`` rounds; an
epoch is 64 steps. The step time is the wall time from the end of the first epoch to the
end of the last, divided by the steps between (a run's steady rate, epoch ends and their
drains included). Beside it, PyTorch on the same model and batch: DDP with 4 ranks (gloo,
one thread each) and one process (``benchmarks/torch_ddp.py``, median of its steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEPS_PER_EPOCH = 64


def _optimizer(name: str):
    from dask_ipar import SGD, Adam

    return Adam(lr=0.001) if name == "adam" else SGD(lr=0.01, momentum=0.9)


def _dask_step(client, cfg, k: int, epochs: int, optimizer: str = "sgd") -> float:
    from dask_ipar.runtime.loop import Callback

    class Ends(Callback):
        def __init__(self):
            self.t = {}

        def on_step_end(self, loop, stats):
            self.t[stats.step] = time.perf_counter()

    X, y = cfg.data(STEPS_PER_EPOCH)
    model = cfg.build_model().distribute(client, "2x2")
    ends = Ends()
    try:
        model.fit(X, y, epochs=epochs, batch_size=cfg.batch, optimizer=_optimizer(optimizer),
                  steps_per_program=k, callbacks=[ends])
    finally:
        model.close()
    last = epochs * STEPS_PER_EPOCH
    return (ends.t[last] - ends.t[STEPS_PER_EPOCH]) / (last - STEPS_PER_EPOCH)


def _torch_step(cfg, procs: int, steps: int = 40) -> float | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(
            [sys.executable, os.path.join(here, "torch_ddp.py"), "--procs", str(procs),
             "--widths", ",".join(map(str, cfg.widths)), "--batch", str(cfg.batch),
             "--steps", str(steps)], capture_output=True, text=True, timeout=600, check=True)
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        print(f"PyTorch peer failed ({exc}); reported as missing", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])["step_s"]


def main(argv=None):
    import benchmarks.common as C

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ks", default="1,4,8,16", help="steps_per_program values to compare")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--json", default=None, help="write the results here too")
    a = p.parse_args(argv)
    ks = [int(k) for k in a.ks.split(",")]
    cfg = C.TINY
    cores = os.cpu_count() or 1
    times: dict = {k: [] for k in ks}
    cluster, client, _ = C.local_cluster(4, cores)
    try:
        _dask_step(client, cfg, 1, 2)  # warm-up: imports, the exchange plugin, the links
        for r in range(a.rounds):
            for k in ks:
                times[k].append(_dask_step(client, cfg, k, a.epochs, a.optimizer))
                print(f"round {r + 1}: steps_per_program {k}: "
                      f"{times[k][-1] * 1e3:.1f} ms per step", file=sys.stderr)
    finally:
        client.close()
        cluster.close()
    ddp = _torch_step(cfg, 4)
    single = _torch_step(cfg, 1)
    res = {"model": cfg.describe(), "grid": "2x2", "cores": cores, "rounds": a.rounds,
           "optimizer": a.optimizer,
           "epochs": a.epochs, "steps_per_epoch": STEPS_PER_EPOCH,
           "dask_step_s": {k: statistics.median(v) for k, v in times.items()},
           "dask_steps_s": times, "ddp4_step_s": ddp, "torch1_step_s": single}
    print(f"tiny MLP {cfg.describe()} on 2x2 ({cores} cores), {a.optimizer}, median of "
          f"{a.rounds} rounds:")
    print("| steps per program | step (ms) | vs DDP 4 ranks | limit 10 ms |")
    print("|---|---|---|---|")
    for k in ks:
        s = res["dask_step_s"][k]
        vs = f"{s / ddp:.2f}" if ddp else "-"
        print(f"| {k} | {s * 1e3:.1f} | {vs} | {'PASS' if s <= 0.010 else 'MISS'} |")
    for name, s in (("PyTorch DDP, 4 ranks (gloo; momentum SGD)", ddp),
                    ("PyTorch, one process (momentum SGD)", single)):
        print(f"{name}: " + (f"{s * 1e3:.2f} ms per step" if s else "not measured"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
