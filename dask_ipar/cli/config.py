"""``dask-ipar config show``: print the effective configuration."""

from __future__ import annotations

import json
import sys

from dask_ipar.config import ConfigError, apply_overrides, load_config, register, validate
from dask_ipar.errors import IparError

__all__ = ["add_parser", "run", "TRAIN_FLAGS", "config_from_args"]


def add_parser(subparsers):
    """Register the ``config`` subcommand (with its ``show`` action) on ``subparsers``.

    Returns the ``config`` parser.
    """
    p = subparsers.add_parser(
        "config",
        help="show the effective configuration (defaults, dask-ipar.yaml, DASK_IPAR__ vars)",
        description="Inspect the configuration that `dask-ipar train` would use: the defaults, "
        "merged with one YAML file (--config, else $DASK_IPAR_CONFIG, else ./dask-ipar.yaml) "
        "and the DASK_IPAR__SECTION__KEY environment variables.",
    )
    sub = p.add_subparsers(dest="config_command", metavar="ACTION")
    show = sub.add_parser("show", help="print the effective configuration as YAML (or JSON)")
    show.add_argument("--config", metavar="FILE", help="YAML config file to read")
    show.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    """Run ``dask-ipar config ...``; returns the exit status (IparError propagates)."""
    from dask_ipar.config import to_yaml

    if getattr(args, "config_command", None) != "show":
        print("usage: dask-ipar config show [--config FILE] [--json]", file=sys.stderr)
        return 2
    cfg = load_config(args.config, register_config=False)
    source = cfg.get("_file")
    clean = {k: v for k, v in cfg.items() if not k.startswith("_")}
    if args.json:
        print(json.dumps(clean, indent=2))
    else:
        print(f"# effective dask-ipar configuration (file: {source or 'none, defaults'})")
        print(to_yaml(clean), end="")
    return 0


#: ``dask-ipar train`` flags (argparse ``dest``) and the config key each one overrides.
TRAIN_FLAGS = {
    "grid": "grid",
    "hidden": "model.hidden",
    "model": "model.kind",
    "filters": "model.filters",
    "conv": "model.conv",
    "dtype": "model.dtype",
    "lr": "optimizer.lr",
    "optimizer": "optimizer.kind",
    "clip_norm": "optimizer.clip_norm",
    "momentum": "optimizer.momentum",
    "weight_decay": "optimizer.weight_decay",
    "epochs": "train.epochs",
    "batch": "train.batch",
    "seed": "train.seed",
    "executor": "train.executor",
    "replicas": "train.replicas",
    "steps_per_program": "train.steps_per_program",
    "data": "data.path",
    "machine": "machine",
    "cluster": "cluster.kind",
    "workers": "cluster.workers",
    "scheduler_address": "cluster.scheduler_address",
    "connect_timeout": "cluster.connect_timeout",
    "wait_timeout": "cluster.wait_timeout",
    "checkpoint_dir": "checkpoint.dir",
    "checkpoint_every": "checkpoint.every",
    "val_fraction": "data.val_fraction",
    "input_shape": "data.input_shape",
    "shuffle_window": "data.shuffle_window",
    "lr_schedule": "optimizer.schedule",
    "early_stopping": "train.patience",
}


def config_from_args(args) -> dict:
    """The effective configuration of a command: ``--config FILE`` (or the usual file),
    ``DASK_IPAR__*`` variables, then every flag of :data:`TRAIN_FLAGS` that is not None.

    Flags the parser lacks are skipped; ``--no-dashboard`` sets ``cluster.dashboard``
    to false. The result is validated and registered into ``dask.config``.

    Parameters
    ----------
    args : argparse.Namespace
        Flags must default to None so that unset ones leave the config alone.
    """
    cfg = load_config(getattr(args, "config", None), register_config=False, check=False)
    over = {key: getattr(args, dest) for dest, key in TRAIN_FLAGS.items() if hasattr(args, dest)}
    if getattr(args, "no_dashboard", False):
        over["cluster.dashboard"] = False
    if getattr(args, "no_standardize", False):
        over["data.standardize"] = False
    if getattr(args, "nesterov", False):
        over["optimizer.nesterov"] = True
    source = cfg.pop("_file", None)
    cfg = apply_overrides(cfg, over)
    try:
        validate(cfg)
    except ConfigError as exc:  # a flag's value: said in the flag's terms
        flag = next((dest for dest, key in TRAIN_FLAGS.items()
                     if key == exc.key and over.get(key) is not None), None)
        if flag is None:
            raise
        value = exc.value
        if isinstance(value, list):
            value = ",".join(map(str, value)) or "''"
        raise IparError(f"--{flag.replace('_', '-')} {value}: expected {exc.expected}."
                        f"{(' ' + exc.fix) if exc.fix else ''}") from None
    if cfg.get("matmul") == "torch":  # before a cluster starts: PyTorch installed here
        from dask_ipar.kernels.blas import check_setting

        check_setting("torch")
    register(cfg)
    cfg["_file"] = source
    return cfg
