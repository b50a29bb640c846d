"""Short GPU benchmark: MLP and CNN SGD step times on 1 GPU (dask-ipar, CuPy blocks) against
NumPy on the CPU and PyTorch on the GPU when present; gradient equality CuPy vs NumPy in
float32 for both.

Run by scripts/gpu_check.sh; writes one JSON file.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from common import median_time


def numpy_step(widths, batch, dtype):
    """One single-process NumPy MLP SGD step (the CPU reference)."""
    from dask_ipar.reference import mlp_loss_and_grads, sgd_step

    rng = np.random.default_rng(0)
    params = [(rng.standard_normal((o, i)).astype(dtype) * 0.01, np.zeros(o, dtype))
              for i, o in zip(widths[:-1], widths[1:])]
    X = rng.standard_normal((widths[0], batch)).astype(dtype)
    y = rng.integers(0, widths[-1], batch)
    acts = ["relu"] * (len(widths) - 2) + ["linear"]

    def step():
        nonlocal params
        _, _, g = mlp_loss_and_grads(params, acts, X, y)
        params, _ = sgd_step(params, [None] * len(params), g, 0.01)
    return step


def torch_step(widths, batch):
    import torch

    layers = []
    for i, o in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(i, o), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1]).cuda()
    return _torch_sgd_step(model, torch.randn(batch, widths[0], device="cuda"),
                           torch.randint(0, widths[-1], (batch,), device="cuda"))


def _torch_sgd_step(model, X, y):
    """One PyTorch SGD step (momentum 0.9) of ``model`` on ``(X, y)``, synchronised."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(X), y).backward()
        opt.step()
        torch.cuda.synchronize()
    return step


#: The CNN of the benchmark: (C, H, W) input, two conv + pool stages, two dense layers.
CNN_INPUT = (3, 64, 64)
CNN_BATCH = 64


def cnn_layers():
    from dask_ipar.nn.layers import Conv2d, Dense, Flatten, MaxPool2d

    return [Conv2d(32, 3, activation="relu"), MaxPool2d(2), Conv2d(64, 3, activation="relu"),
            MaxPool2d(2), Flatten(), Dense(256, "relu"), Dense(10)]


def cnn_flops():
    """FLOPs of one CNN SGD step: 3 x (2 x MACs of the forward pass)."""
    c, h, w = CNN_INPUT
    macs = h * w * 32 * c * 9 + (h // 2) * (w // 2) * 64 * 32 * 9
    macs += 64 * (h // 4) * (w // 4) * 256 + 256 * 10
    return 6.0 * CNN_BATCH * macs


def numpy_cnn_step(dtype):
    """One single-process NumPy CNN SGD step (the reference implementation, on the CPU)."""
    from dask_ipar.reference import cnn_loss_and_grads, sgd_step

    layers = cnn_layers()
    c, h, w = CNN_INPUT
    shapes = [(32, c, 3, 3), (64, 32, 3, 3), (256, 64 * (h // 4) * (w // 4)), (10, 256)]
    rng = np.random.default_rng(0)
    params = [((rng.standard_normal(s) * np.sqrt(2 / np.prod(s[1:]))).astype(dtype),
               np.zeros(s[0], dtype)) for s in shapes]
    X = rng.standard_normal((CNN_BATCH, *CNN_INPUT)).astype(dtype)
    y = rng.integers(0, 10, CNN_BATCH)

    def step():
        nonlocal params
        g = cnn_loss_and_grads(layers, params, X, y)[3]
        params, _ = sgd_step(params, [None] * len(params), g, 0.01)
    return step


def torch_cnn_step():
    import torch

    nn = torch.nn
    c, h, w = CNN_INPUT
    model = nn.Sequential(nn.Conv2d(c, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(64 * (h // 4) * (w // 4), 256), nn.ReLU(),
                          nn.Linear(256, 10)).cuda()
    return _torch_sgd_step(model, torch.randn(CNN_BATCH, *CNN_INPUT, device="cuda"),
                           torch.randint(0, 10, (CNN_BATCH,), device="cuda"))


def _max_grad_err(a, b):
    from dask_ipar.testing import rel_err

    return max(max(rel_err(g[0], c[0]), rel_err(g[1], c[1])) for g, c in zip(a, b))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/gpu.json")
    ap.add_argument("--tests-rc", type=int, default=None)
    ap.add_argument("--widths", default="4096,4096,4096,4096,10")
    ap.add_argument("--batch", type=int, default=1024)
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    from distributed import Client, LocalCluster

    from dask_ipar import SGD, Dense, Sequential
    from dask_ipar.testing import awkward_problem

    res = {"widths": widths, "batch": args.batch, "gpu_tests_rc": args.tests_rc}
    flops = 6 * args.batch * sum(i * o for i, o in zip(widths[:-1], widths[1:]))
    res["numpy_cpu_step_s"] = median_time(numpy_step(widths, args.batch, np.float32), 1, 3)
    with LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=None) as cl, \
            Client(cl) as client:
        # gradient equality CuPy vs NumPy, float32
        X, y = awkward_problem()
        grads = {}
        for device in ("cpu", "cuda"):
            m = Sequential([Dense(29, "relu"), Dense(13, "tanh"), Dense(10)], input_dim=37,
                           dtype="float32", device=device).distribute(client, "1x1")
            grads[device] = m.gradients(X, y)[2]
            m.close()
        res["grad_rel_err_cupy_vs_numpy_f32"] = _max_grad_err(grads["cuda"], grads["cpu"])
        # the same for a CNN (conv with strides and padding, pooling, flatten, dense)
        from dask_ipar.testing import awkward_cnn

        layers, shape = awkward_cnn()
        rng = np.random.default_rng(1)
        Xc, yc = rng.standard_normal((9, *shape)), rng.integers(0, 8, 9)
        for device in ("cpu", "cuda"):
            m = Sequential(layers, input_shape=shape, dtype="float32", seed=0,
                           device=device).distribute(client, "1x1")
            grads[device] = m.gradients(Xc, yc)[2]
            m.close()
        res["cnn_grad_rel_err_cupy_vs_numpy_f32"] = _max_grad_err(grads["cuda"], grads["cpu"])
        rng = np.random.default_rng(0)
        Xb = rng.standard_normal((args.batch, widths[0])).astype(np.float32)
        yb = rng.integers(0, widths[-1], args.batch)
        m = Sequential([Dense(w, "relu") for w in widths[1:-1]] + [Dense(widths[-1])],
                       input_dim=widths[0], device="cuda").distribute(client, "1x1")
        m.embed_bytes = 0
        opt = SGD(lr=0.01)
        res["dask_ipar_cuda_step_s"] = median_time(
            lambda: client.gather(m.train_step(Xb, yb, opt)), 2, 5)
        m.close()
        # CNN step on 1 GPU
        Xi = rng.standard_normal((CNN_BATCH, *CNN_INPUT)).astype(np.float32)
        yi = rng.integers(0, 10, CNN_BATCH)
        m = Sequential(cnn_layers(), input_shape=CNN_INPUT, device="cuda").distribute(client,
                                                                                     "1x1")
        m.embed_bytes = 0
        res["cnn"] = {"input": CNN_INPUT, "batch": CNN_BATCH, "flops": cnn_flops()}
        res["cnn"]["dask_ipar_cuda_step_s"] = median_time(
            lambda: client.gather(m.train_step(Xi, yi, opt)), 2, 5)
        m.close()
    res["cnn"]["numpy_cpu_step_s"] = median_time(numpy_cnn_step(np.float32), 1, 2)
    try:
        res["cnn"]["torch_cuda_step_s"] = median_time(torch_cnn_step(), 2, 5)
    except Exception:  # torch absent or without CUDA
        res["cnn"]["torch_cuda_step_s"] = None
    try:
        res["torch_cuda_step_s"] = median_time(torch_step(widths, args.batch), 2, 5)
    except Exception as exc:  # torch absent or without CUDA
        res["torch_cuda_step_s"] = None
        res["torch_note"] = f"{type(exc).__name__}: {exc}"
    res["dask_ipar_cuda_tflops"] = flops / res["dask_ipar_cuda_step_s"] / 1e12
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
