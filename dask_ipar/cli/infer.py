"""``dask-ipar predict`` and ``dask-ipar evaluate``: a saved model (``train --save``) on a
data file, on a grid of local workers or an existing cluster."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import numpy as np

from dask_ipar.cli.args import (
    add_cluster_flags,
    command_cluster,
    eprint,
    positive_int,
    report,
    resolve_grid,
)
from dask_ipar.errors import IparError

__all__ = ["add_parsers", "run_predict", "run_evaluate"]


def _common(p):
    p.add_argument("model_file", metavar="MODEL.npz", help="a model saved by train --save")
    p.add_argument("--data", metavar="PATH", required=True,
                   help=".npz, .npy, Zarr or HDF5 with X (and y for evaluate)")
    p.add_argument("--grid", help="process grid PRxPC (default 1xP)")
    p.add_argument("--workers", type=positive_int, help="worker processes P (default 1)")
    add_cluster_flags(p, "the forward passes")
    p.add_argument("--batch", type=positive_int, default=4096,
                   help="samples per forward pass (default 4096)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def add_parsers(sub):
    p = sub.add_parser("predict", help="predicted classes of a data file by a saved model",
                       description="Run a model saved by `dask-ipar train --save` on the "
                       "features of --data (standardized as in training) and write the "
                       "predicted class of every sample.")
    _common(p)
    p.add_argument("--output", "-o", metavar="FILE",
                   help="write the classes to FILE (.npy, or text: one per line); default "
                   "stdout")
    p.set_defaults(func=run_predict)
    p = sub.add_parser("evaluate", help="loss and accuracy of a saved model on a data file",
                       description="Mean cross-entropy and accuracy of a model saved by "
                       "`dask-ipar train --save` on the features and labels of --data.")
    _common(p)
    p.set_defaults(func=run_evaluate)


def _features(path):
    """X of a data file, with y when it has labels (else None). Zarr, HDF5 and .npy are
    read by the grid's workers (:mod:`dask_ipar.io.lazy`), never loaded here."""
    from dask_ipar.io.data import load_dataset

    low = os.fspath(path).lower()
    try:
        return load_dataset(path, lazy=True)
    except IparError:
        if not os.path.isfile(path) or not low.endswith((".npy", ".npz")):
            raise
    try:  # features without labels
        if low.endswith(".npy"):  # a memmap: the workers read it
            return np.load(path, mmap_mode="r", allow_pickle=False), None
        with np.load(path, allow_pickle=False) as z:
            return np.asarray(z["X"]), None
    except (KeyError, ValueError, OSError) as exc:
        raise IparError(f"--data {path}: no features X could be read ({exc}).") from None


def _open(args):
    from dask_ipar.model import Sequential

    grid = resolve_grid(args.grid, args.workers or (None if args.grid else 1))
    model = Sequential.load(args.model_file)
    X, y = _features(args.data)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    client_cm = command_cluster(args, grid.size)
    return model, X, y, grid, client_cm


def run_predict(args) -> int:
    t0 = time.perf_counter()
    model, X, _, grid, client_cm = _open(args)
    with client_cm as client:
        model.distribute(client, grid)
        classes = np.asarray(model.predict(X, batch_size=args.batch))  # a dask array for
        model.close()  # stored data: its blocks are on the workers until computed here
    secs = time.perf_counter() - t0
    if args.output:
        if args.output.lower().endswith(".npy"):
            np.save(args.output, classes)
        else:
            np.savetxt(args.output, classes, fmt="%d")
        eprint(f"dask-ipar: {len(classes)} predictions written to {args.output} in "
               f"{secs:.1f} s")
    elif not args.json:
        sys.stdout.write("\n".join(map(str, classes.tolist())) + "\n")
    if args.json:
        out = {"samples": int(len(classes)), "grid": str(grid), "seconds": secs,
               "output": args.output}
        if not args.output:
            out["classes"] = classes.tolist()
        print(json.dumps(out))
    return 0


def run_evaluate(args) -> int:
    t0 = time.perf_counter()
    model, X, y, grid, client_cm = _open(args)
    if y is None:
        raise IparError(f"--data {args.data} holds no labels y; evaluate needs them (predict "
                        "does not).")
    with client_cm as client:
        model.distribute(client, grid)
        r = model.evaluate(X, y, batch_size=args.batch)
        model.close()
    out = {"samples": int(len(y)), "loss": float(r["loss"]), "accuracy": float(r["accuracy"]),
           "grid": str(grid), "seconds": time.perf_counter() - t0}
    return report(args, f"accuracy {out['accuracy']:.4f} (loss {out['loss']:.4f}) on "
                  f"{len(y)} samples", out)
