"""PyTorch DistributedDataParallel (gloo, CPU) step time of the benchmark MLP.

    python benchmarks/torch_ddp.py --procs 2 --widths 8192,8192,8192,10 --batch 128 --steps 5

Prints one JSON line: {"procs", "threads", "step_s", "steps_s"}. ``--procs 1`` runs a
plain single-process PyTorch step (no DDP). Every rank gets B/P samples; torch
threads per process = max(1, cores // procs). The step is forward, backward (DDP's
gradient all-reduce included) and momentum SGD; rank 0 reports the median after one
warm-up step, with a barrier before each timed step.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(widths):
    from peers import build_mlp  # the benchmarks' one PyTorch MLP

    return build_mlp(widths)


def _run(rank, procs, widths, batch, steps, threads, port, q):
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(threads)
    if procs > 1:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=procs)
    model = _build(widths)
    if procs > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    lossf = nn.CrossEntropyLoss()
    b = batch // procs + (rank < batch % procs)
    g = torch.Generator().manual_seed(rank)
    X = torch.randn(b, widths[0], generator=g)
    y = torch.randint(0, widths[-1], (b,), generator=g)
    ts = []
    for k in range(steps + 1):
        if procs > 1:
            dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = lossf(model(X), y)
        loss.backward()
        opt.step()
        if k:
            ts.append(time.perf_counter() - t0)
    if procs > 1:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        q.put({"procs": procs, "threads": threads, "step_s": statistics.median(ts), "steps_s": ts})


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--widths", default="4096,4096,4096,4096,10")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    a = ap.parse_args(argv)
    widths = [int(w) for w in a.widths.split(",")]
    threads = max(1, a.cores // a.procs)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    if a.procs == 1:
        _run(0, 1, widths, a.batch, a.steps, threads, 0, q)
    else:
        mp.spawn(_run, args=(a.procs, widths, a.batch, a.steps, threads, _free_port(), q),
                 nprocs=a.procs, join=True)
    print(json.dumps(q.get()))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
