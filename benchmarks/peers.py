"""PyTorch peers of dask-ipar (gloo, CPU): DDP, FSDP and tensor + data parallel.

One process per rank; :mod:`netcluster` starts each rank in a network namespace of its own
on the emulated links (``run_peer``), so the peers cross the same tbf-limited links as
dask-ipar's workers. A rank::

    python benchmarks/peers.py --mode ddp|fsdp|tp --mesh PRxPC --rank R --world P \\
        --master 10.213.0.50:29500 --widths 8192,8192,8192,10 --batch 128 --steps 5

Modes (the batch of B samples is split over the data-parallel ranks):

* ``ddp``: ``DistributedDataParallel`` (gradient all-reduce in buckets, overlapped with
  the backward), ``--mesh 1xP``.
* ``fsdp``: FSDP2 ``fully_shard`` on every linear layer and on the model (parameters
  all-gathered per layer, gradients reduce-scattered), ``--mesh 1xP``.
* ``tp``: Megatron-style tensor parallel (of the dense layers; a CNN's convs are
  replicated over the ``tp`` ranks and data parallel over ``dp``) on a 2-D ``DeviceMesh`` (``dp``, ``tp``) =
  (PC, PR): the linear layers alternate ``ColwiseParallel`` and ``RowwiseParallel`` over
  the ``tp`` ranks (a column-parallel last layer gathers its logits); the gradients of
  each rank's shards are then summed over the ``dp`` ranks as one flat all-reduce after
  the backward (data parallel without DDP's overlap, which DDP does not offer for
  DTensor parameters). ``--mesh Px1`` is tensor parallel alone.

``pingpong`` (two ranks or more; ranks 0 and 1 take part) is the link itself: the median
round trip of a 4-byte tensor (``send``/``recv``, halved: one hop) and the time of a
64 MiB one-way transfer, ``{"hop_4B_s", "t_64MiB_s", "bandwidth_Bps"}``.

The step is forward, cross-entropy, backward and momentum SGD, as dask-ipar's. Rank 0
prints one JSON line: ``{"mode", "mesh", "step_s" (median after one warm-up step, a
barrier before each), "steps_s", "loss0"}``. ``--check`` also runs the same first step on
one process with the whole batch and prints its loss as ``loss0_single``: the peers are
the same computation (the benchmark compares them within float32 rounding).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

MODES = ("ddp", "fsdp", "tp", "pingpong")


def build(spec: dict, seed: int = 0):
    """The model of ``spec``: ``{"kind": "mlp", "widths"}`` or ``{"kind": "cnn", "image",
    "filters", "dense", "classes"}`` (3x3 same-padded convs with ReLU, each followed by a
    2x2 max pooling, then the dense layers), as benchmarks/common.py's configurations."""
    if spec["kind"] == "mlp":
        return build_mlp(spec["widths"], seed)
    import torch
    from torch import nn

    torch.manual_seed(seed)
    c, h, w = spec["image"]
    layers = []
    for f in spec["filters"]:
        layers += [nn.Conv2d(c, f, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        c, h, w = f, h // 2, w // 2
    layers.append(nn.Flatten())
    widths = [c * h * w, *spec["dense"], spec["classes"]]
    for k, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if k < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def build_mlp(widths, seed: int = 0):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers = []
    for k, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if k < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def batch_of(spec: dict, batch: int, seed: int = 0):
    """The whole batch (every rank draws the same one and keeps its share)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if spec["kind"] == "mlp":
        shape, classes = (spec["widths"][0],), spec["widths"][-1]
    else:
        shape, classes = tuple(spec["image"]), spec["classes"]
    X = torch.randn(batch, *shape, generator=g)
    y = torch.randint(0, classes, (batch,), generator=g)
    return X, y


def share(n: int, parts: int, k: int) -> slice:
    """Part ``k`` of ``n`` items cut into ``parts`` balanced runs."""
    lo = k * (n // parts) + min(k, n % parts)
    return slice(lo, lo + n // parts + (k < n % parts))


def parse_mesh(text: str) -> tuple[int, int]:
    pr, pc = (int(v) for v in text.lower().split("x"))
    return pr, pc


def _tensor_parallel(model, mesh):
    from torch import nn
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    linear = [name for name, mod in model.named_children() if isinstance(mod, nn.Linear)]
    plan = {}
    for k, name in enumerate(linear):
        if k % 2 == 0:
            last = k == len(linear) - 1
            plan[name] = ColwiseParallel(output_layouts=Replicate()) if last else \
                ColwiseParallel()
        else:
            plan[name] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def _sum_over(group, size, params):
    """Sum the local gradients over ``group`` (one flat all-reduce), then average."""
    import torch
    import torch.distributed as dist

    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= size
    off = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[off:off + n].view_as(g))
        off += n


def pingpong(rank: int, reps: int = 50) -> dict | None:
    """One hop of a 4-byte tensor and a 64 MiB transfer between ranks 0 and 1."""
    import torch
    import torch.distributed as dist

    small = torch.zeros(1, dtype=torch.float32)
    big = torch.zeros(16 * 2**20, dtype=torch.float32)  # 64 MiB
    hops, bigs = [], []
    dist.barrier()
    if rank in (0, 1):
        other = 1 - rank
        for _ in range(reps):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(small, other)
                dist.recv(small, other)
            else:
                dist.recv(small, other)
                dist.send(small, other)
            hops.append((time.perf_counter() - t0) / 2)
        for _ in range(3):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(big, other)
                dist.recv(small, other)  # the receiver's acknowledgement
            else:
                dist.recv(big, other)
                dist.send(small, other)
            bigs.append(time.perf_counter() - t0)
    dist.barrier()
    if rank != 0:
        return None
    t = statistics.median(bigs) - statistics.median(hops)
    return {"mode": "pingpong", "hop_4B_s": statistics.median(hops), "t_64MiB_s": t,
            "bandwidth_Bps": 64 * 2**20 / t}


def rank_main(a) -> dict | None:
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(a.threads)
    host, port = a.master.rsplit(":", 1)
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=port)
    dist.init_process_group("gloo", rank=a.rank, world_size=a.world)
    if a.mode == "pingpong":
        out = pingpong(a.rank)
        dist.destroy_process_group()
        return out
    spec = json.loads(a.spec) if a.spec else {
        "kind": "mlp", "widths": [int(w) for w in a.widths.split(",")]}
    pr, pc = parse_mesh(a.mesh)
    if pr * pc != a.world:
        raise SystemExit(f"--mesh {a.mesh} has {pr * pc} ranks, --world is {a.world}")
    model = build(spec)
    X, y = batch_of(spec, a.batch)
    dp_group = dp_size = None
    if a.mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
        part = share(a.batch, a.world, a.rank)
    elif a.mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (a.world,))
        for mod in model:
            if isinstance(mod, (nn.Linear, nn.Conv2d)):
                fully_shard(mod, mesh=mesh)
        fully_shard(model, mesh=mesh)
        part = share(a.batch, a.world, a.rank)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (pc, pr), mesh_dim_names=("dp", "tp"))
        model = _tensor_parallel(model, mesh["tp"])
        dp_size = pc
        dp_group = mesh["dp"].get_group() if pc > 1 else None
        part = share(a.batch, pc, mesh["dp"].get_local_rank())
    Xr, yr = X[part], y[part]
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    lossf = nn.CrossEntropyLoss()
    params = [p for p in model.parameters() if p.requires_grad]
    ts, loss0 = [], None
    for k in range(a.steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = lossf(model(Xr), yr)
        loss.backward()
        if dp_group is not None:
            _sum_over(dp_group, dp_size, params)
        opt.step()
        if k == 0:
            loss0 = float(loss.detach())
        else:
            ts.append(time.perf_counter() - t0)
    dist.barrier()
    # the mean loss over the whole batch (each dp rank holds the loss of its share)
    whole = torch.tensor([loss0 * (part.stop - part.start)])
    dist.all_reduce(whole)
    dist.destroy_process_group()
    if a.rank != 0:
        return None
    tp_ranks = pr if a.mode == "tp" else 1
    out = {"mode": a.mode, "mesh": a.mesh, "threads": a.threads,
           "step_s": statistics.median(ts), "steps_s": ts,
           "loss0": float(whole[0]) / (a.batch * tp_ranks)}
    if a.check:
        ref = build(spec)
        out["loss0_single"] = float(lossf(ref(X), y).detach())
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument("--mesh", required=True, help="PRxPC: tensor-parallel x data-parallel ranks")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True, help="host:port of rank 0")
    ap.add_argument("--widths", default=None, help="an MLP's widths, d0,d1,...,classes")
    ap.add_argument("--spec", default=None, help="the model as JSON (see build)")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    if not (a.widths or a.spec):
        ap.error("give --widths or --spec")
    out = rank_main(a)
    if out is not None:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
