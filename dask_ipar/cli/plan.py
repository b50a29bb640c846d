"""``dask-ipar plan``: choose the Pr x Pc grid for a network without a cluster.

Wire it into the main CLI with ``plan_cli.add_parser(subparsers)``; the
subcommand calls :func:`run`.  Never imports dask.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from dask_ipar.cost.machine import PAPER_MACHINE, Machine, load_machine, parse_bandwidth, parse_bytes
from dask_ipar.cost.networks import get_network
from dask_ipar.cost.planner import MODES, PlanResult, plan

__all__ = ["add_parser", "run", "format_table", "plot_plan"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``plan`` subcommand on an argparse ``subparsers`` object."""
    p = subparsers.add_parser(
        "plan",
        help="choose the Pr x Pc grid with the alpha-beta cost model (no cluster needed)",
        description=(
            "Evaluate every factorization P = Pr x Pc with the cost model of Gholami et al. (SPAA 2018) "
            "and report the fastest grid. Defaults: the paper's machine (alpha 2us, 6 GiB/s, 4-byte words)."
        ),
    )
    p.add_argument("--model", default="alexnet", help="alexnet, vgg16, resnet50 or a width list such as 784,4096,10")
    p.add_argument("--batch", type=int, required=True, help="mini-batch size B")
    p.add_argument("--procs", type=int, required=True, help="number of processes P")
    p.add_argument("--alpha", type=float, default=None, help="latency per message, seconds (default 2e-6)")
    p.add_argument("--bandwidth", default=None, help="bytes/s, suffixes allowed: 6GiB, 10Gbit, 125MB (default 6GiB)")
    p.add_argument("--word-bytes", type=int, default=None, help="bytes per word (default 4)")
    p.add_argument("--compute-s-per-iter", type=float, default=None, help="measured compute seconds per iteration")
    p.add_argument("--samples", type=int, default=None, help="training samples N; report per epoch (N/B iterations)")
    p.add_argument("--conv", choices=MODES, default="auto", help="how conv layers are parallelised (default auto)")
    p.add_argument("--overlap", action="store_true", help="hide the weight all-reduce behind backward compute")
    p.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default="sgd",
                   help="optimizer whose state the memory per process counts: sgd (momentum, "
                   "one copy of the owned weights), adam/adamw (two moments); default sgd")
    p.add_argument("--replicas", type=int, default=0, metavar="N",
                   help="price in-memory replicas refreshed every N steps (dask-ipar train "
                   "--replicas): their transfer per step and two snapshots per process in the "
                   "memory; default 0 (none)")
    p.add_argument("--mem-limit", default=None, help="bytes per process, suffixes allowed (e.g. 16GiB)")
    p.add_argument("--machine", default=None, metavar="FILE", help="YAML machine file; flags override its values")
    p.add_argument("--convention", choices=("engine", "paper"), default="engine",
                   help="engine: what dask-ipar sends (default); paper: the paper's Eq. 3/4/8 formulas")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write stacked bars per grid (needs matplotlib)")
    p.set_defaults(func=run)
    return p


class _InputError(ValueError):
    pass


def _machine_from_args(args) -> Machine:
    machine = load_machine(args.machine) if args.machine else PAPER_MACHINE
    changes = {}
    if args.alpha is not None:
        if not (math.isfinite(args.alpha) and args.alpha >= 0):
            raise _InputError(f"--alpha: got {args.alpha!r}; expected a non-negative latency in seconds, e.g. --alpha 2e-6")
        changes["alpha_s"] = args.alpha
    if args.bandwidth is not None:
        changes["bandwidth_Bps"] = parse_bandwidth(args.bandwidth, name="--bandwidth")
    if args.word_bytes is not None:
        if args.word_bytes < 1:
            raise _InputError(f"--word-bytes: got {args.word_bytes}; expected a positive integer such as 4")
        changes["word_bytes"] = args.word_bytes
    if args.compute_s_per_iter is not None:
        if not (math.isfinite(args.compute_s_per_iter) and args.compute_s_per_iter >= 0):
            raise _InputError(f"--compute-s-per-iter: got {args.compute_s_per_iter!r}; expected seconds >= 0")
        changes["compute_s_per_iter"] = args.compute_s_per_iter
    return machine.replace(**changes) if changes else machine


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def format_table(result: PlanResult, *, title: str = "") -> str:
    """Human-readable table: one row per grid, the best marked with ``*``."""
    lines = [title] if title else []
    rep = any(g.feasible and g.replica_comm_s for g in result.grids)
    head = (f"  {'Pr':>6} {'Pc':>6} {'compute_s':>11} {'batch_comm_s':>13} {'model_comm_s':>13} "
            f"{'domain_comm_s':>14}" + (f" {'replica_s':>11}" if rep else "")
            + f" {'total_s':>11} {'mem/proc':>10}")
    lines.append(f"times per {result.unit}")
    lines.append(head)
    for g in result.grids:
        mark = "*" if g is result.best else " "
        if g.feasible:
            lines.append(
                f"{mark} {g.pr:>6} {g.pc:>6} {g.compute_s:>11.4g} {g.batch_comm_s:>13.4g} {g.model_comm_s:>13.4g} "
                f"{g.domain_comm_s:>14.4g}" + (f" {g.replica_comm_s:>11.4g}" if rep else "")
                + f" {g.total_s:>11.4g} {_fmt_bytes(g.mem_bytes):>10}"
            )
        else:
            lines.append(f"  {g.pr:>6} {g.pc:>6}   excluded: {g.reason}")
    if result.best is None:
        lines.append("no grid is feasible")
    else:
        b = result.best
        s = result.speedup_vs_batch
        cs = result.comm_speedup_vs_batch
        if s is None:
            lines.append(f"best: {b.pr} x {b.pc} (pure batch {1} x {result.procs} is not feasible)")
        else:
            comm = "inf" if cs is None or math.isinf(cs) else f"{cs:.2f}x"
            lines.append(f"best: {b.pr} x {b.pc}, speedup vs pure batch {s:.2f}x (communication {comm})")
        if b.schemes and any(s_ != "model" for _, s_ in b.schemes):
            lines.append("layers: " + ", ".join(f"{n}={s_}" for n, s_ in b.schemes))
    return "\n".join(lines)


def plot_plan(result: PlanResult, path: str, *, title: str = "") -> None:
    """Stacked bars per grid (compute, batch, model, domain communication), like the paper's figures."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise _InputError(
            "--plot: matplotlib is not installed; install it with `pip install dask-ipar[plots]` "
            "(or `pip install matplotlib`), or drop --plot"
        ) from None
    grids = result.feasible
    labels = [f"{g.pr}x{g.pc}" for g in grids]
    parts = [("compute", "compute_s", "#9e9e9e"), ("batch comm", "batch_comm_s", "#1f77b4"),
             ("model comm", "model_comm_s", "#ff7f0e"), ("domain comm", "domain_comm_s", "#2ca02c")]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(grids) + 2), 4))
    bottom = [0.0] * len(grids)
    for label, attr, color in parts:
        vals = [getattr(g, attr) for g in grids]
        if any(vals):
            ax.bar(labels, vals, bottom=bottom, label=label, color=color)
            bottom = [b + v for b, v in zip(bottom, vals)]
    if result.best is not None and result.best in grids:
        i = grids.index(result.best)
        ax.annotate("best", (i, bottom[i]), ha="center", va="bottom")
    ax.set_xlabel("grid Pr x Pc")
    ax.set_ylabel(f"seconds per {result.unit}")
    ax.set_title(title.replace("; ", "\n"), fontsize=9)
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=45, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args) -> int:
    """Run ``dask-ipar plan``; returns the exit code (2 on bad input)."""
    try:
        if args.batch is None or args.batch < 1:
            raise _InputError(f"--batch: got {args.batch}; expected a positive mini-batch size, e.g. --batch 256")
        if args.procs is None or args.procs < 1:
            raise _InputError(f"--procs: got {args.procs}; expected a positive process count, e.g. --procs 64")
        if args.samples is not None and args.samples < 1:
            raise _InputError(f"--samples: got {args.samples}; expected a positive sample count, e.g. --samples 1200000")
        mem_limit = None if args.mem_limit is None else parse_bytes(args.mem_limit, name="--mem-limit")
        if mem_limit is not None and mem_limit <= 0:
            raise _InputError(f"--mem-limit: got {args.mem_limit!r}; expected a positive size such as 16GiB")
        if args.replicas < 0:
            raise _InputError(f"--replicas: got {args.replicas}; expected 0 (none) or the steps "
                              "between refreshes, e.g. --replicas 10")
        machine = _machine_from_args(args)
        layers = get_network(args.model)
        result = plan(layers, args.procs, args.batch, machine, conv=args.conv, overlap=args.overlap,
                      mem_limit_bytes=mem_limit, convention=args.convention, samples=args.samples,
                      opt_slots=1 if args.optimizer == "sgd" else 2, replicas=args.replicas)
        title = (f"{args.model}: B={args.batch}, P={args.procs}, conv={args.conv}, convention={args.convention}"
                 f"{', overlap' if args.overlap else ''}; alpha={machine.alpha_s:g} s, "
                 f"bandwidth={machine.bandwidth_Bps:.4g} B/s, word={machine.word_bytes} B")
        if args.plot:
            plot_plan(result, args.plot, title=title)
        if args.json:
            print(json.dumps(result.to_dict(), indent=2))
        else:
            print(format_table(result, title=title))
        return 0 if result.best is not None else 1
    except ValueError as exc:
        msg = str(exc)
        if not msg.startswith("--") and not msg.startswith("dask-ipar"):
            msg = msg.replace("model:", "--model:", 1) if msg.startswith("model:") else msg
        print(f"dask-ipar plan: error: {msg}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    """Stand-alone entry point, ``python -m dask_ipar.cli.plan plan ...``."""
    parser = argparse.ArgumentParser(prog="dask-ipar")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
