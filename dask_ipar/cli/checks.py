"""Checks of a ``dask-ipar train`` run's inputs made before any cluster starts, each failing
with one line in the command's own terms: the flag as the user typed it, what was expected,
and the fix.
"""

from __future__ import annotations

import os

import numpy as np

from dask_ipar.errors import IparError

__all__ = ["check_scheduler_address", "check_data", "check_resume"]


def _source(args, flag: str, key: str) -> str:
    """How the user gave a setting: ``--flag`` when on the command line, else the config key."""
    dest = flag.lstrip("-").replace("-", "_")
    return flag if getattr(args, dest, None) is not None else f"config {key}"


def check_scheduler_address(args, address) -> None:
    """A scheduler address dask can connect to: ``[protocol://]host:port``."""
    if not address:
        return
    from distributed.comm import parse_address
    from distributed.comm.addressing import parse_host_port

    where = _source(args, "--scheduler-address", "cluster.scheduler_address")
    try:
        protocol, location = parse_address(address)
        if protocol in ("tcp", "tls", "ucx", "ws", "wss"):
            parse_host_port(location)
    except (ValueError, TypeError):
        raise IparError(
            f"{where} {address}: expected a scheduler address such as tcp://10.0.0.5:8786 "
            "(protocol, host and port, as the scheduler prints when it starts)."
        ) from None


def check_data(args, name: str, Xtr, ytr, Xte, yte, n_classes: int, batch: int, grid,
               test_fraction: float) -> None:
    """The data fits the run: labels are class indices, the batch fits the training split,
    and each split has a sample for every grid column."""
    where = _source(args, "--data", "data.path")
    from dask_ipar.io.lazy import labels_of

    labels = np.unique(np.concatenate([labels_of(ytr).ravel(), labels_of(yte).ravel()]))
    if labels.size and 2 * labels.size < n_classes:
        raise IparError(
            f"{where} {name}: the labels run up to {n_classes - 1}, so the model would have "
            f"{n_classes} classes, but only {labels.size} distinct labels occur "
            f"({', '.join(map(str, labels[:8]))}{', ...' if labels.size > 8 else ''}). Labels "
            "must be class indices 0..K-1: renumber them (e.g. numpy.unique(y, "
            "return_inverse=True))."
        )
    n_train, n_test = len(ytr), len(yte)
    if n_train < grid.pc or (test_fraction > 0 and n_test < grid.pc):
        split, n = ("training", n_train) if n_train < grid.pc else ("test", n_test)
        cols = max(1, n)
        raise IparError(
            f"{where} {name}: {n_train + n_test} samples leave {n} in the {split} split "
            f"(test fraction {test_fraction:g}), fewer than the grid's {grid.pc} batch-"
            f"parallel columns, which each need a sample. Use more data, or a grid with at "
            f"most {cols} column{'s' if cols > 1 else ''} (e.g. --grid 1x{cols})."
        )
    if batch > n_train:
        raise IparError(
            f"{_source(args, '--batch', 'train.batch')} {batch} is larger than the {n_train} "
            f"training samples of {name}; use --batch {n_train} or less."
        )


def check_resume(args, directory, settings: dict) -> None:
    """``--resume``: a checkpoint to resume from, saved with the same training settings.

    ``settings`` are the run's ``optimizer``, ``batch_size`` and ``seed`` as the checkpoint
    stores them; a difference is refused unless ``--resume-changed`` allows it.
    """
    from dask_ipar.io import checkpoint

    if not args.resume:
        return
    found = checkpoint.checkpoints(directory)
    if not found:
        state = "does not exist" if not os.path.isdir(directory) else "holds no checkpoint"
        raise IparError(
            f"--resume: {directory} {state}, so there is nothing to resume. Drop --resume to "
            "start a new run there, or give the --checkpoint-dir of the run to continue."
        )
    saved = None
    for _, path in reversed(found):  # what the resume will load: the newest that reads
        try:
            saved = checkpoint.read_metadata(path).get("extra") or {}
            break
        except IparError:
            continue
    if saved is None or getattr(args, "resume_changed", False):
        return  # none reads: the load reports why; or the user allows the change
    flags = {"lr": "--lr", "momentum": "--momentum", "weight_decay": "--weight-decay"}
    changed = []
    old_kind = saved.get("optimizer", {}).get("kind", "sgd")
    if old_kind != settings["optimizer"]["kind"]:
        changed.append(f"--optimizer {settings['optimizer']['kind']} (the checkpoint's run used "
                       f"{old_kind})")
    if bool(saved.get("optimizer", {}).get("nesterov", False)) != bool(
            settings["optimizer"].get("nesterov", False)):
        changed.append("--nesterov " + ("on" if settings["optimizer"].get("nesterov") else "off")
                       + " (the checkpoint's run had it "
                       + ("on)" if saved.get("optimizer", {}).get("nesterov") else "off)"))
    for k, flag in flags.items():
        old, new = saved.get("optimizer", {}).get(k), settings["optimizer"].get(k)
        if old is not None and new is not None and old != new:
            changed.append(f"{flag} {new:g} (the checkpoint's run used {old:g})")
    if "clip_norm" in saved.get("optimizer", {}) and (
            saved["optimizer"]["clip_norm"] != settings["optimizer"].get("clip_norm")):
        changed.append(f"--clip-norm {settings['optimizer'].get('clip_norm') or 'none'} (the "
                       f"checkpoint's run used {saved['optimizer']['clip_norm'] or 'none'})")
    norm = lambda v: None if v is None or str(v).strip().lower() in ("", "none",  # noqa: E731
                                                                    "constant") else str(v)
    old_s = norm(saved.get("optimizer", {}).get("schedule"))
    new_s = norm(settings["optimizer"].get("schedule"))
    if "schedule" in saved.get("optimizer", {}) and old_s != new_s:
        changed.append(f"--lr-schedule {new_s or 'none'} (the checkpoint's run used "
                       f"{old_s or 'none'})")
    for k, flag in (("batch_size", "--batch"), ("seed", "--seed"), ("epochs", "--epochs")):
        if saved.get(k) is not None and settings.get(k) is not None and saved[k] != settings[k]:
            changed.append(f"{flag} {settings[k]} (the checkpoint's run used {saved[k]})")
    if changed:
        raise IparError(
            "--resume would continue with other settings than the run that saved the "
            f"checkpoints: {'; '.join(changed)}. Use the run's settings to continue it "
            "exactly, or add --resume-changed to continue with the new ones."
        )
