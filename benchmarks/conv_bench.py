"""Local conv kernel (forward + backward) against PyTorch CPU conv2d, same shapes and threads.

python benchmarks/conv_bench.py [--threads 1] [--batch 8] [--shapes alexnet|cnn] [--pool]
(needs torch for the comparison). Prints a markdown table; the issue's target is at most 2x
PyTorch. ``--shapes cnn``: the convs of the peer sweep's CNN (``common.CNN``: 3x64x64, 3x3
convs 32-32-64-64, each after a 2x2 max pooling of the one before).

``--pool``: instead, the CNN's 2x2 max poolings' backward (the input gradient, the
forward it recomputes included) on ReLU outputs (ties at zero), side by side: the tiled
path the engine takes, the window-by-window path (``tiled=False``) and PyTorch's
``max_pool2d`` backward; ratios over the tiled path.
"""

from __future__ import annotations

import argparse

import numpy as np
from common import median_time

from dask_ipar.kernels import conv as C
SHAPES = [  # name, C, H, W, O, k, stride, pad, groups (AlexNet's conv layers)
    ("conv1", 3, 227, 227, 96, 11, 4, 0, 1),
    ("conv2", 96, 27, 27, 256, 5, 1, 2, 2),
    ("conv3", 256, 13, 13, 384, 3, 1, 1, 1),
    ("conv4", 384, 13, 13, 384, 3, 1, 1, 2),
]
CNN_SHAPES = [  # the peer sweep's CNN (benchmarks/common.py: CNN), 'same' 3x3 convs
    ("conv0", 3, 64, 64, 32, 3, 1, 1, 1),
    ("conv1", 32, 32, 32, 32, 3, 1, 1, 1),
    ("conv2", 32, 16, 16, 64, 3, 1, 1, 1),
    ("conv3", 64, 8, 8, 64, 3, 1, 1, 1),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shapes", choices=("alexnet", "cnn"), default="alexnet")
    ap.add_argument("--pool", action="store_true", help="the max poolings' backward instead")
    args = ap.parse_args()
    if args.pool:
        return pool_main(args)
    shapes = SHAPES if args.shapes == "alexnet" else CNN_SHAPES
    from threadpoolctl import threadpool_limits

    try:
        import torch

        torch.set_num_threads(args.threads)
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    print("| layer | shape | dask-ipar fwd+bwd (s) | PyTorch fwd+bwd (s) | ratio |")
    print("|---|---|---|---|---|")
    with threadpool_limits(args.threads):
        for name, c, h, w, o, k, s, p, g in shapes:
            x = rng.standard_normal((args.batch, c, h, w)).astype(np.float32)
            wt = rng.standard_normal((o, c // g, k, k)).astype(np.float32)
            b = np.zeros(o, np.float32)
            pad = (p, p, p, p)

            def ours():
                y = C.conv2d_forward(x, wt, b, s, pad, g)
                C.conv2d_backward(x, wt, np.ones_like(y), s, pad, g)

            t_ours = median_time(ours, 1, args.reps)
            t_torch = None
            if torch is not None:
                tx = torch.from_numpy(x).requires_grad_()
                tw = torch.from_numpy(wt).requires_grad_()
                tb = torch.from_numpy(b).requires_grad_()

                def theirs():
                    y = torch.nn.functional.conv2d(tx, tw, tb, stride=s, padding=p, groups=g)
                    y.backward(torch.ones_like(y))

                t_torch = median_time(theirs, 1, args.reps)
            ratio = "" if t_torch is None else f"{t_ours / t_torch:.2f}"
            shape = f"{args.batch}x{c}x{h}x{w}, {o} {k}x{k}/{s} g{g}"
            print(f"| {name} | {shape} | {t_ours:.3f} | "
                  f"{'' if t_torch is None else f'{t_torch:.3f}'} | {ratio} |")


POOL_SHAPES = [  # the CNN's poolings: (channels, height, width) of their inputs, k = 2
    ("pool1", 32, 64, 64), ("pool3", 32, 32, 32), ("pool5", 64, 16, 16), ("pool7", 64, 8, 8),
]


def pool_main(args):
    from threadpoolctl import threadpool_limits

    try:
        import torch

        torch.set_num_threads(args.threads)
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    print("| pooling | input | tiled (ms) | window by window (ms) | PyTorch (ms) | "
          "window by window / tiled | PyTorch / tiled |")
    print("|---|---|---|---|---|---|---|")
    with threadpool_limits(args.threads):
        for name, c, h, w in POOL_SHAPES:
            x = np.maximum(rng.standard_normal((args.batch, c, h, w)).astype(np.float32), 0)
            dy = rng.standard_normal((args.batch, c, h // 2, w // 2)).astype(np.float32)
            t_tiled = median_time(lambda: C.pool2d_backward(x, dy, 2), 1, args.reps)
            t_win = median_time(lambda: C.pool2d_backward(x, dy, 2, tiled=False), 1, args.reps)
            t_torch = None
            if torch is not None:
                tx = torch.from_numpy(x).requires_grad_()
                tdy = torch.from_numpy(dy)

                def theirs():
                    tx.grad = None
                    torch.nn.functional.max_pool2d(tx, 2).backward(tdy)

                t_torch = median_time(theirs, 1, args.reps)
            tt = "" if t_torch is None else f"{t_torch * 1e3:.2f}"
            rt = "" if t_torch is None else f"{t_torch / t_tiled:.2f}"
            print(f"| {name} | {args.batch}x{c}x{h}x{w} ({x.nbytes / 2**20:.1f} MiB) | "
                  f"{t_tiled * 1e3:.2f} | {t_win * 1e3:.2f} | {tt} | {t_win / t_tiled:.2f} | "
                  f"{rt} |")


if __name__ == "__main__":
    main()
