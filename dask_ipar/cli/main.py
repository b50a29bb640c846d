"""The ``dask-ipar`` command line: ``train`` (the main job) and ``plan``."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time

from dask_ipar.cli import checks
from dask_ipar.errors import IparError

__all__ = ["main", "build_parser"]


def _eprint(*args):
    print(*args, file=sys.stderr, flush=True)


def _positive_int(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _widths(text):
    """``--hidden`` / ``--filters``: comma-separated positive widths; ``none`` for no
    hidden layer (an empty value is refused: it would silently drop every layer)."""
    if text.strip().lower() == "none":
        return []
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated widths such as 128,64, got {text!r}"
        ) from None
    if not out:
        raise argparse.ArgumentTypeError(
            f"{text!r} names no width; give widths such as 128,64 (or 'none' for no hidden "
            "layer)")
    if any(w < 1 for w in out):
        raise argparse.ArgumentTypeError(f"widths must be positive, got {text!r}")
    return out


def _add_train(sub):
    p = sub.add_parser(
        "train",
        help="train an MLP on the bundled digits data set (the main job)",
        description="Train an MLP classifier (by default on scikit-learn's bundled 8x8 digits) "
        "with the integrated model+batch (1.5D) scheme on a Pr x Pc grid of dask workers. "
        "Settings come from dask-ipar.yaml (see `dask-ipar config show`); flags override it.",
    )
    p.add_argument("--config", metavar="FILE",
                   help="dask-ipar.yaml (default: $DASK_IPAR_CONFIG, else ./dask-ipar.yaml)")
    p.add_argument("--grid", help="process grid PRxPC, e.g. 2x1 (default: 1xP, pure batch)")
    p.add_argument("--workers", type=_positive_int,
                   help="number of worker processes P (default: the grid's size, else 2)")
    p.add_argument("--epochs", type=_positive_int, help="passes over the data (default 10)")
    p.add_argument("--batch", type=_positive_int, help="global mini-batch size B (default 64)")
    p.add_argument("--lr", type=float, help="learning rate (default 0.05)")
    p.add_argument("--momentum", type=float, help="SGD momentum (default 0.9)")
    p.add_argument("--weight-decay", type=float, help="L2 weight decay (default 1e-4)")
    p.add_argument("--model", choices=["mlp", "cnn"],
                   help="mlp (default): dense layers; cnn: domain-parallel 3x3 conv + 2x2 "
                   "max-pool blocks (--filters), then the dense layers (digits upsampled to "
                   "16x16)")
    p.add_argument("--hidden", type=_widths,
                   help="hidden layer widths, comma separated (default 128,64)")
    p.add_argument("--filters", type=_widths,
                   help="cnn: conv filters per block, comma separated (default 16,32)")
    p.add_argument("--conv", choices=["domain", "model", "batch", "auto"],
                   help="cnn: conv layers domain-parallel (default), model-parallel (filters "
                   "over Pr), batch-parallel (samples over all P), or auto: the cost model "
                   "picks each layer's scheme and, without --grid, the grid of --workers "
                   "processes")
    p.add_argument("--dtype", choices=["float32", "float64"], help="default float32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: CuPy blocks in GPU memory (needs the gpu extra); the local "
                   "cluster then uses dask-cuda's LocalCUDACluster when there is a GPU per "
                   "worker, else workers that share the GPUs")
    p.add_argument("--seed", type=int, help="data split, initialization, shuffling (default 0)")
    p.add_argument("--executor", choices=["programs", "graph"],
                   help="programs: two dask tasks per worker and step (default); graph: a dask "
                        "task per kernel, every layer and phase in the dashboard's task stream, "
                        "same results, far more scheduler work")
    p.add_argument("--data", metavar="PATH",
                   help=".npz, .npy, Zarr or HDF5 with X and y (default: the bundled digits)")
    p.add_argument("--cluster", choices=["local", "slurm", "pbs", "lsf", "sge"],
                   help="where the workers run (default local; batch systems need the hpc "
                   "extra and the cluster section of the config)")
    p.add_argument("--scheduler-address",
                   help="use the dask cluster at this address instead of starting one")
    p.add_argument("--connect-timeout", type=float,
                   help="seconds to try reaching --scheduler-address (default 10)")
    p.add_argument("--wait-timeout", type=float,
                   help="seconds to wait for enough workers (default 60)")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="save model and optimizer state to Zarr checkpoints here")
    p.add_argument("--checkpoint-every", type=_positive_int, metavar="N",
                   help="steps between checkpoints (default: at the end)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--resume-changed", action="store_true",
                   help="with --resume: allow other --lr, --momentum, --weight-decay, --batch "
                        "or --seed than the run that saved the checkpoints")
    p.add_argument("--machine", metavar="FILE",
                   help="YAML machine file (alpha, bandwidth) for the predicted seconds")
    p.add_argument("--report", metavar="FILE.html",
                   help="write a self-contained HTML run card (model, grid, predicted vs "
                   "measured communication, dask's performance report)")
    p.add_argument("--no-dashboard", action="store_true", help="start no dashboard")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--json", action="store_true",
                   help="end with one JSON object on stdout (everything else goes to stderr)")
    p.set_defaults(func=run_train)


def _resolve_grid(grid_text, workers):
    from dask_ipar.layout.grid import Grid, parse_grid

    if grid_text is not None:
        grid = parse_grid(grid_text)
        if workers is not None and workers != grid.size:
            raise IparError(
                f"--grid {grid} has P = Pr*Pc = {grid.size} cells but --workers is {workers}; "
                f"they must agree: use --workers {grid.size} or a grid whose Pr*Pc = {workers}."
            )
        return grid
    return Grid(1, workers or 2)


@contextlib.contextmanager
def _performance_report(path):
    """Record dask's performance report (inline bokeh) when a run card is asked for."""
    from dask_ipar.runtime.cluster import _has_bokeh

    out = {}
    if not path or not _has_bokeh():
        yield out
        return
    from distributed import performance_report

    with tempfile.TemporaryDirectory() as tmp:
        fname = os.path.join(tmp, "dask-report.html")
        with performance_report(filename=fname, mode="inline"):
            yield out
        with open(fname, encoding="utf-8") as fh:
            out["html"] = fh.read()


def _load_data(cfg):
    """Training and test data: a file from the config, else the bundled digits."""
    import numpy as np

    from dask_ipar.io.data import load_digits_images, load_digits_split

    t = cfg["train"]
    if not cfg["data"]["path"]:
        if cfg["model"].get("kind") == "cnn":
            return (*load_digits_images(upsample=2, seed=t["seed"]), 10, "digits 16x16")
        return (*load_digits_split(seed=t["seed"]), 10, "digits")
    from dask_ipar.io.data import load_dataset, train_test_split

    X, y = load_dataset(cfg["data"]["path"], chunk_rows=64 * t["batch"])
    Xtr, ytr, Xte, yte = train_test_split(X, y, cfg["data"]["test_fraction"], t["seed"])
    return Xtr, ytr, Xte, yte, int(np.max(np.asarray(y))) + 1, cfg["data"]["path"]


def run_train(args) -> int:
    from dask_ipar.runtime.cluster import make_cluster
    from dask_ipar.runtime.cluster import dashboard_link
    from dask_ipar.config import config_from_args
    from dask_ipar.nn.layers import Dense
    from dask_ipar.model import Sequential
    from dask_ipar.optim import SGD

    cfg = config_from_args(args)
    t, o, ck = cfg["train"], cfg["optimizer"], cfg["checkpoint"]
    grid = _resolve_grid(cfg["grid"], cfg["cluster"]["workers"])
    if args.resume and not ck["dir"]:
        raise IparError("--resume needs --checkpoint-dir DIR (or checkpoint.dir in the config).")
    checks.check_scheduler_address(args, cfg["cluster"]["scheduler_address"])
    if ck["dir"]:
        checks.check_resume(args, ck["dir"], {
            "optimizer": {"lr": o["lr"], "momentum": o["momentum"],
                          "weight_decay": o["weight_decay"]},
            "batch_size": t["batch"], "seed": t["seed"]})
    machine = None
    if cfg["machine"]:
        from dask_ipar.cost import load_machine

        try:
            machine = load_machine(cfg["machine"])
        except ValueError as exc:
            raise IparError(str(exc)) from None
    optimizer = SGD(lr=o["lr"], momentum=o["momentum"], weight_decay=o["weight_decay"])
    if t["batch"] < grid.pc:
        raise IparError(
            f"--batch {t['batch']} is smaller than the grid's Pc = {grid.pc} batch-parallel "
            f"columns; use --batch {grid.pc} or more, or a grid with fewer columns."
        )
    Xtr, ytr, Xte, yte, n_classes, data_name = _load_data(cfg)
    checks.check_data(args, data_name, Xtr, ytr, Xte, yte, n_classes, t["batch"], grid,
                      cfg["data"]["test_fraction"] if cfg["data"]["path"] else 0.2)
    layers = [Dense(w, "relu") for w in cfg["model"]["hidden"]] + [Dense(n_classes)]
    kind = cfg["model"].get("kind", "mlp")
    if kind == "cnn":
        import numpy as np

        if np.ndim(Xtr) != 4:
            raise IparError(
                f"--model cnn needs images (n, channels, height, width); the data has shape "
                f"{tuple(np.shape(Xtr))}. Save X with that shape, or train an MLP."
            )
        from dask_ipar.nn.layers import Conv2d, Flatten, MaxPool2d

        conv = cfg["model"].get("conv", "domain")
        front = [lay for f in cfg["model"]["filters"]
                 for lay in (Conv2d(f, 3, activation="relu",
                                    parallel="domain" if conv == "auto" else conv),
                             MaxPool2d(2))]
        layers = front + [Flatten()] + layers
        if conv == "auto":
            from dask_ipar.nn.planning import plan_layers

            grid, layers, chosen = plan_layers(layers, tuple(Xtr.shape[1:]), grid.size,
                                               t["batch"], machine, grid=cfg["grid"])
            from dask_ipar.cost import LOOPBACK_MACHINE

            used = machine or LOOPBACK_MACHINE
            _eprint(f"dask-ipar: planner (conv auto): grid {grid}, " + ", ".join(
                f"{n} {s}" for n, s in chosen.schemes if n.startswith("conv"))
                + f"; machine alpha {used.alpha_s:g} s, {used.bandwidth_Bps:.3g} B/s ("
                + (cfg["machine"] if machine else "the loopback default; --machine FILE from "
                   "`dask-ipar calibrate` for this cluster's own") + ")")
        model = Sequential(layers, input_shape=tuple(Xtr.shape[1:]),
                           dtype=cfg["model"]["dtype"], seed=t["seed"], device=args.device)
        layers = model.dense_layers
        widths = "conv " + "-".join(map(str, cfg["model"]["filters"])) + " / dense " + \
            "-".join(map(str, model.sizes[-len(layers) - 1:]))
    else:
        model = Sequential(layers, input_dim=Xtr.shape[1], dtype=cfg["model"]["dtype"],
                           seed=t["seed"], device=args.device)
        widths = "-".join(map(str, model.sizes))
    t_start = time.perf_counter()
    # The cluster's own start-up and shutdown chatter is not the user's business.
    logging.getLogger("distributed").setLevel(logging.ERROR)
    history = None
    with make_cluster(cfg, grid.size, device=args.device, log=_eprint) as client:
        link = dashboard_link(client) if cfg["cluster"]["dashboard"] else None
        rows = "domain/model-parallel" if kind == "cnn" else "model-parallel"
        _eprint(f"dask-ipar: {kind.upper()} {widths} on {data_name}, grid {grid} ({grid.pr} "
                f"{rows} rows x {grid.pc} batch-parallel columns), batch {t['batch']}, "
                f"{cfg['model']['dtype']}, executor {t['executor']}")
        if link:
            _eprint(f"dask-ipar: dashboard at {link}")
        model.distribute(client, grid)
        model.executor = t["executor"]
        t_fit = time.perf_counter()
        if ck["dir"]:
            from dask_ipar.io import checkpoint
            steps = t["epochs"] * (Xtr.shape[0] // t["batch"])
            done = checkpoint.train_with_checkpoints(
                model, Xtr, ytr, steps=steps, every=ck["every"] or steps, directory=ck["dir"],
                batch_size=t["batch"], optimizer=optimizer, seed=t["seed"], resume=args.resume,
                keep=ck["keep"], wait_timeout_s=cfg["cluster"]["wait_timeout"],
                log=lambda m: _eprint(f"dask-ipar: {m}"))
            # the samples of the steps this run made (a resumed run did not make the first)
            n_seen = (done["steps"] - done["start"]) * t["batch"]
            train_loss = done["losses"][-1] if done["losses"] else float("nan")
            train_acc = None
        else:
            with _performance_report(args.report) as perf:
                history = model.fit(Xtr, ytr, epochs=t["epochs"], batch_size=t["batch"],
                                    optimizer=optimizer, seed=t["seed"],
                                    progress=not args.no_progress, machine=machine)
            n_seen = sum(e["samples_per_s"] * e["seconds"] for e in history.epochs)
            train_loss, train_acc = history.last["loss"], history.last["accuracy"]
        fit_s = time.perf_counter() - t_fit
        result = model.evaluate(Xte, yte)
        summary = {
            "grid": str(grid), "pr": grid.pr, "pc": grid.pc, "model": widths,
            "data": data_name, "dtype": cfg["model"]["dtype"], "device": args.device,
            "batch": t["batch"], "epochs": t["epochs"], "executor": t["executor"],
            "train_loss": train_loss, "train_accuracy": train_acc,
            "test_loss": result["loss"], "test_accuracy": result["accuracy"],
            "fit_seconds": fit_s, "samples_per_s": n_seen / fit_s,
        }
        if history is not None:
            summary["comm"] = [r.to_dict() for r in history.comm.rows]
            _eprint(history.comm.table())
        if args.report:
            if history is None:
                _eprint("dask-ipar: no run card for checkpointed runs (--report needs a plain fit)")
            else:
                from dask_ipar.io.report import write_run_card

                write_run_card(args.report, summary, history, model, perf.get("html"))
                _eprint(f"dask-ipar: run card written to {args.report}")
        model.close()
    summary["seconds"] = time.perf_counter() - t_start
    line = (f"test accuracy {result['accuracy']:.4f} (loss {result['loss']:.4f}) after "
            f"{t['epochs']} epochs, {summary['samples_per_s']:.0f} samples/s, "
            f"{summary['seconds']:.1f} s total")
    if args.json:
        _eprint(line)
        print(json.dumps(summary))
    else:
        print(line)
    return 0


def _add_calibrate(sub):
    p = sub.add_parser(
        "calibrate",
        help="measure alpha, bandwidth and compute rate of a cluster into a machine file",
        description="Measure the latency per dependent hop, the worker-to-worker bandwidth and "
        "the matmul rate of one worker on a live dask cluster (under a minute) and write a "
        "YAML machine file for `dask-ipar plan --machine` and `dask-ipar train --machine`.",
    )
    p.add_argument("--output", "-o", default="machine.yaml", help="machine file to write")
    p.add_argument("--workers", type=_positive_int, default=2,
                   help="worker processes of the LocalCluster to start (default 2)")
    p.add_argument("--threads-per-worker", type=_positive_int, default=1)
    p.add_argument("--scheduler-address", help="measure an existing cluster instead")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--json", action="store_true", help="print the machine as JSON on stdout")
    p.set_defaults(func=run_calibrate)


def run_calibrate(args) -> int:
    from dask_ipar.runtime.calibrate import calibrate
    from dask_ipar.runtime.cluster import open_client
    from dask_ipar.cost import save_machine

    if args.workers < 2 and not args.scheduler_address:
        raise IparError("calibration needs --workers 2 or more (it times transfers between two).")
    logging.getLogger("distributed").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    with open_client(None if args.scheduler_address else args.workers, args.scheduler_address,
                     threads_per_worker=args.threads_per_worker, dashboard=False,
                     log=_eprint) as client:
        machine = calibrate(client, dtype=args.dtype, log=lambda m: _eprint(f"dask-ipar: {m}"))
    save_machine(machine, args.output)
    _eprint(f"dask-ipar: wrote {args.output} in {time.perf_counter() - t0:.1f} s")
    if args.json:
        print(json.dumps({"alpha_s": machine.alpha_s, "bandwidth_Bps": machine.bandwidth_Bps,
                          "word_bytes": machine.word_bytes, "flops_per_s": machine.flops_per_s}))
    return 0


def _add_verify(sub):
    p = sub.add_parser(
        "verify",
        help="check a grid against single-process NumPy and the cost model, per layer",
        description="Run a float64 MLP on the grid beside a single-process NumPy reference: "
        "forward, loss, every gradient, a finite-difference check, a few SGD steps, and the "
        "bytes moved per layer and phase against the cost model. Prints pass/fail per layer.",
    )
    p.add_argument("--grid", required=True, help="process grid PRxPC")
    p.add_argument("--model", type=_widths, default=[37, 29, 13, 10],
                   help="layer widths including input and classes (default 37,29,13,10)")
    p.add_argument("--batch", type=_positive_int, default=23)
    p.add_argument("--steps", type=_positive_int, default=3, help="SGD steps to compare")
    p.add_argument("--scheduler-address", help="use an existing cluster")
    p.set_defaults(func=run_verify)


def run_verify(args) -> int:
    from dask_ipar.runtime.cluster import open_client
    from dask_ipar.testing import compare_mlp

    grid = _resolve_grid(args.grid, None)
    if len(args.model) < 2:
        raise IparError(f"--model needs at least an input and an output width, got {args.model}.")
    acts = ["relu"] * (len(args.model) - 2) + ["linear"]
    logging.getLogger("distributed").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    with open_client(None if args.scheduler_address else grid.size, args.scheduler_address,
                     dashboard=False, log=_eprint) as client:
        err = compare_mlp(client, grid, sizes=tuple(args.model), activations=tuple(acts),
                          batch=args.batch, steps=args.steps)
    tol = {"grad": 1e-12, "sgd": 1e-10, "fd": 1e-6, "bytes": 0.02}
    ok_all = True
    print(f"grid {grid}, MLP {'-'.join(map(str, args.model))}, B = {args.batch}, float64")
    head = f"{'layer':<8}{'dW err':>10}{'db err':>10}{'SGD err':>10}  bytes measured/predicted"
    print(head)
    rows = err["comm"].rows
    for k in range(len(args.model) - 1):
        name = f"dense{k}"
        ratios = {r.phase: r.ratio for r in rows if r.layer == name}
        ok = (err[f"dW{k}"] <= tol["grad"] and err[f"db{k}"] <= tol["grad"]
              and err[f"sgd{k}"] <= tol["sgd"]
              and all(abs(v - 1) <= tol["bytes"] for v in ratios.values()))
        ok_all &= ok
        bytes_txt = " ".join(f"{ph}={v:.3f}" for ph, v in ratios.items())
        print(f"{name:<8}{err[f'dW{k}']:>10.1e}{err[f'db{k}']:>10.1e}{err[f'sgd{k}']:>10.1e}  "
              f"{bytes_txt}  {'PASS' if ok else 'FAIL'}")
    fwd_ok = err["logits"] <= tol["grad"] and err["loss"] <= tol["grad"]
    fd_ok = err["finite_difference"] <= tol["fd"]
    ok_all &= fwd_ok and fd_ok
    print(f"forward logits {err['logits']:.1e}, loss {err['loss']:.1e}  "
          f"{'PASS' if fwd_ok else 'FAIL'}")
    print(f"finite difference {err['finite_difference']:.1e}  {'PASS' if fd_ok else 'FAIL'}")
    print(f"{'PASS' if ok_all else 'FAIL'} in {time.perf_counter() - t0:.1f} s")
    return 0 if ok_all else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dask-ipar",
        description="Integrated model, batch and domain parallel training on dask.distributed.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_train(sub)
    _add_calibrate(sub)
    _add_verify(sub)
    try:
        from dask_ipar.cli import plan as plan_cli
    except ImportError:  # pragma: no cover - the planner ships with the package
        plan_cli = None
    if plan_cli is not None:
        plan_cli.add_parser(sub)
    from dask_ipar.cli import config as config_cli
    config_cli.add_parser(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except IparError as exc:
        _eprint(f"dask-ipar {args.command}: error: {exc}")
        return 2
    except KeyboardInterrupt:
        _eprint("dask-ipar: interrupted; the cluster was shut down")
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
