"""Argument types and small helpers shared by the ``dask-ipar`` subcommands."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from dask_ipar.errors import IparError

__all__ = ["eprint", "positive_int", "steps_per_program", "fraction", "widths", "resolve_grid", "report",
           "cluster_line", "add_cluster_flags", "command_cluster", "mute_interrupt_noise"]


def eprint(*args):
    print(*args, file=sys.stderr, flush=True)


def _int_at_least(text, lo: int, what: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = lo - 1
    if v < lo:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return v


def positive_int(text):
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text):
    return _int_at_least(text, 0, "an integer >= 0")


def steps_per_program(text):
    """``--steps-per-program``: ``auto`` or a whole number from 1 to
    :data:`~dask_ipar.runtime.steps.MAX_STEPS_PER_PROGRAM`."""
    from dask_ipar.runtime.steps import MAX_STEPS_PER_PROGRAM as most

    if text.strip().lower() == "auto":
        return "auto"
    what = f"a whole number from 1 to {most}, or auto"
    v = _int_at_least(text, 1, what)
    if v > most:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return v


def widths(text):
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


def fraction(text):
    """A share in [0, 1), e.g. ``--val-fraction 0.1``."""
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1) such as 0.1, got {text!r}")
    return v


def resolve_grid(grid_text, workers):
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


def report(args, line: str, summary: dict) -> int:
    """End a command: its one result line on stdout, or with ``--json`` the line on stderr
    and ``summary`` as one JSON object on stdout. Returns 0."""
    import json

    if getattr(args, "json", False):
        eprint(line)
        print(json.dumps(summary))
    else:
        print(line)
    return 0


def cluster_line(client, cfg: dict, link: str | None) -> str:
    """``dask-ipar: scheduler tcp://...:8786, 4 workers; dashboard http://...`` for the
    cluster a command runs on. A batch cluster's dashboard listens on 127.0.0.1 of this
    host (a login node, typically): the line says how to reach it from elsewhere."""
    import socket

    from dask_ipar.runtime.workers import scheduler_workers

    n = len(scheduler_workers(client))
    line = f"dask-ipar: scheduler {client.scheduler.address}, {n} worker{'s' if n != 1 else ''}"
    if link:
        line += f"; dashboard {link}"
        kind = cfg.get("cluster", {}).get("kind", "local")
        if kind != "local" and not cfg.get("cluster", {}).get("scheduler_address"):
            port = link.split(":")[2].split("/")[0]
            host = socket.gethostname()
            line += (f" on {host} (from another machine: ssh -L {port}:127.0.0.1:{port} "
                     f"{host}, then open http://localhost:{port}/status)")
    return line


def add_cluster_flags(p, what: str = "the command", *, config: bool = True,
                      wait_help: str = "seconds to wait for the workers to connect "
                      "(default 600)") -> None:
    """``--config`` (unless ``config`` is false), ``--cluster``, ``--scheduler-address``,
    ``--connect-timeout`` and ``--wait-timeout`` on ``p``: where the workers of ``what``
    run, the same flags for every command."""
    if config:
        p.add_argument("--config", metavar="FILE",
                       help="YAML config file whose cluster section is used (default "
                       "$DASK_IPAR_CONFIG, else ./dask-ipar.yaml)")
    p.add_argument("--cluster", choices=["local", "slurm", "pbs", "lsf", "sge"],
                   help=f"where the workers of {what} run (default local, or cluster.kind of "
                   "the config; batch systems need the hpc extra and the cluster section "
                   "of the config)")
    p.add_argument("--scheduler-address",
                   help="use the dask cluster at this address instead of starting one")
    p.add_argument("--connect-timeout", type=float,
                   help="seconds to try reaching --scheduler-address (default 10)")
    p.add_argument("--wait-timeout", type=float, help=wait_help)


def command_cluster(args, n_workers: int, *, threads_per_worker: int | None = None):
    """The cluster (a context manager yielding a Client) of a command with
    :func:`add_cluster_flags`: the config file's cluster section with the flags over it,
    started by :func:`dask_ipar.runtime.cluster.make_cluster`, without a dashboard. A local
    cluster gets ``threads_per_worker`` threads per worker when given."""
    from dask_ipar.cli.checks import check_scheduler_address
    from dask_ipar.cli.config import config_from_args
    from dask_ipar.runtime.cluster import make_cluster

    # only the cluster flags: the command's other flags (verify's --model widths) are not
    # the train flags of the same names
    flags = argparse.Namespace(**{k: getattr(args, k, None) for k in (
        "config", "cluster", "scheduler_address", "connect_timeout", "wait_timeout")})
    cfg = config_from_args(flags)
    check_scheduler_address(flags, cfg["cluster"]["scheduler_address"])
    cfg["cluster"]["dashboard"] = False
    if cfg["cluster"]["kind"] == "local" and threads_per_worker:
        cfg["cluster"]["cores"] = threads_per_worker * n_workers
    return _announced(make_cluster(cfg, n_workers, log=eprint), cfg)


@contextlib.contextmanager
def _announced(cluster_cm, cfg):
    with cluster_cm as client:
        eprint(cluster_line(client, cfg, None))
        yield client


class _DropInterruptedSyncError(logging.Filter):
    """Drops tornado's "Exception in callback" record of a NameError raised by the
    ``cancel`` callback of ``distributed.utils.sync`` (dask 2026.8): a Ctrl-C or SIGTERM
    that lands while the command waits in a client call before the call's future exists
    makes that callback read an unset variable. The interrupt itself is handled (exit
    130/143); the record was a traceback printed under the command's one line."""

    def filter(self, record):
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, NameError):
            return True
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        code = tb.tb_frame.f_code if tb is not None else None
        return not (code is not None and code.co_name == "cancel"
                    and code.co_filename.replace("\\", "/").endswith("distributed/utils.py"))


class _DropReconnectFailure(logging.Filter):
    """Drops dask's "Failed to reconnect to scheduler after 10.00 seconds, closing client"
    record: the command says in its own line that the scheduler is gone and what to do."""

    def filter(self, record):
        return "Failed to reconnect to scheduler" not in record.getMessage()


def mute_interrupt_noise() -> None:
    """Install :class:`_DropInterruptedSyncError` on tornado's application logger and
    :class:`_DropReconnectFailure` on dask's client logger (once each)."""
    for name, kind in (("tornado.application", _DropInterruptedSyncError),
                       ("distributed.client", _DropReconnectFailure)):
        lg = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in lg.filters):
            lg.addFilter(kind())
