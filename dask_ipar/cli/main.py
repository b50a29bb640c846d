"""The ``dask-ipar`` command line: ``train`` (the main job, :mod:`.train`), ``predict`` and
``evaluate`` (:mod:`.infer`), ``plan``, ``calibrate``, ``verify`` and ``config``."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time

from dask_ipar.cli.args import eprint as _eprint, positive_int as _positive_int
from dask_ipar.cli.args import resolve_grid as _resolve_grid, widths as _widths
from dask_ipar.cli.args import add_cluster_flags, command_cluster
from dask_ipar.errors import IparError

__all__ = ["main", "build_parser"]


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
    p.add_argument("--threads-per-worker", type=_positive_int, default=1,
                   help="threads of each local worker (default 1; batch workers get "
                   "cluster.cores / cluster.processes)")
    add_cluster_flags(p, "the calibration")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--json", action="store_true", help="print the machine as JSON on stdout")
    p.add_argument("--quick", action="store_true",
                   help="fewer repeats and smaller blocks, about 0.6 of the time: noisier "
                   "figures, to check that a cluster works end to end (plan large runs on a "
                   "full calibration)")
    p.set_defaults(func=run_calibrate)


def run_calibrate(args) -> int:
    from dask_ipar.runtime.calibrate import FULL, QUICK, calibrate
    from dask_ipar.cost import save_machine

    if args.workers < 2:
        raise IparError("calibration needs --workers 2 or more (it times transfers between two).")
    logging.getLogger("distributed").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    with command_cluster(args, args.workers,
                         threads_per_worker=args.threads_per_worker) as client:
        machine = calibrate(client, dtype=args.dtype, effort=QUICK if args.quick else FULL,
                            log=lambda m: _eprint(f"dask-ipar: {m}"))
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
    add_cluster_flags(p, "the check")
    p.set_defaults(func=run_verify)


def run_verify(args) -> int:
    from dask_ipar.testing import compare_mlp

    grid = _resolve_grid(args.grid, None)
    if len(args.model) < 2:
        raise IparError(f"--model needs at least an input and an output width, got {args.model}.")
    acts = ["relu"] * (len(args.model) - 2) + ["linear"]
    logging.getLogger("distributed").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    with command_cluster(args, grid.size) as client:
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
    from dask_ipar.cli import train as train_cli

    train_cli.add_parser(sub)
    from dask_ipar.cli import infer as infer_cli

    infer_cli.add_parsers(sub)
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
    # what the user typed (dask's performance report shows it as the calling code)
    args.command_line = "dask-ipar " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help()
        return 2
    from dask_ipar.cli.args import mute_interrupt_noise

    mute_interrupt_noise()
    try:
        return args.func(args)
    except IparError as exc:
        _eprint(f"dask-ipar {args.command}: error: {exc}")
        return 2
    except RuntimeError as exc:
        from dask_ipar.io.checkpoint_faults import WorkerLost

        if not isinstance(exc, WorkerLost):
            raise
        # lost again after the last recovery allowed: one line, not a traceback
        resume = ("continue from its last checkpoint with --resume and the same "
                  "--checkpoint-dir" if getattr(args, "checkpoint_dir", None) else
                  "nothing was saved (no --checkpoint-dir)")
        _eprint(f"dask-ipar {args.command}: error: worker(s) {', '.join(exc.workers)} left "
                f"the cluster during {exc.what} and the run could not recover; {resume}.")
        return 2
    except KeyboardInterrupt as exc:  # before the training loop ran, or a second signal
        import signal

        signum = getattr(exc, "signum", signal.SIGINT)
        _eprint(f"dask-ipar: stopped by {signal.Signals(signum).name}; the cluster was shut "
                "down")
        return 128 + signum


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
