"""``dask-ipar config show``: print the effective configuration."""

from __future__ import annotations

import json
import sys

__all__ = ["add_parser", "run"]


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
    from dask_ipar.config import load_config, to_yaml

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
