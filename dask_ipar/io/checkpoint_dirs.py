"""The checkpoint directory on disk: which ``ckpt-<step>`` checkpoints it holds, and the
file operations that keep it consistent (fsync, atomic publish with the ``LATEST``
pointer, removal of what crashed writes left behind).

Part of :mod:`dask_ipar.io.checkpoint`, which documents the layout and the guarantees.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid

from dask_ipar.errors import IparError

__all__ = ["checkpoints", "latest"]


_NAME = re.compile(r"^ckpt-(\d+)$")
_LATEST = "LATEST"
#: what crashed or failed writes leave behind: unpublished checkpoints, replaced ones
#: moved aside, unfinished LATEST pointers
_LEFTOVER = re.compile(r"^(ckpt-\d+\.(tmp|old)-[0-9a-f]+|LATEST\.tmp-[0-9a-f]+)$")


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    for here, dirs, files in os.walk(root, topdown=False):
        for f in files:
            _fsync_file(os.path.join(here, f))
        _fsync_dir(here)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def checkpoints(directory) -> list[tuple[int, str]]:
    """Complete checkpoints in ``directory`` as ``[(step, path), ...]``, oldest first.

    ``.tmp-*`` directories (unfinished or crashed writes) are never listed. Complete
    means renamed into place; whether a checkpoint verifies is for :func:`load`.
    """
    return [(s, p) for s, p in _ckpt_dirs(os.fspath(directory))
            if os.path.isfile(os.path.join(p, "zarr.json"))]


def _ckpt_dirs(directory: str) -> list[tuple[int, str]]:
    """Every ``ckpt-<step>`` directory, complete or not, oldest first."""
    if not os.path.isdir(directory):
        return []
    out = []
    for name in os.listdir(directory):
        m = _NAME.match(name)
        if m and os.path.isdir(os.path.join(directory, name)):
            out.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(out)


def latest(directory) -> str | None:
    """Path of the newest complete checkpoint in ``directory`` (the highest step), or None
    when there is none; never a ``.tmp`` directory.

    The ``LATEST`` file names the same checkpoint for other tools; it is not needed to
    find it (a ``LATEST`` that is missing, stale or garbage changes nothing).
    """
    found = checkpoints(os.fspath(directory))
    return found[-1][1] if found else None


def _resolve(path) -> str:
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, "zarr.json")):
        return path
    if os.path.isdir(path):
        found = latest(path)
        if found is None:
            raise IparError(
                f"no complete checkpoint in {path!r} (looked for ckpt-<step> directories). "
                "Train with checkpoints first, or pass the right directory."
            )
        return found
    raise IparError(f"checkpoint {path!r} does not exist.")


def _remove_stale(directory: str, before: float, keep_path: str) -> None:
    """Remove leftovers of crashed or failed writes older than ``before`` (a time)."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if path == keep_path or not _LEFTOVER.match(name):
            continue
        try:
            if os.lstat(path).st_mtime >= before:
                continue  # possibly a write in progress
        except OSError:
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(path)


def _publish(tmp: str, final: str, directory: str) -> None:
    """Rename the finished ``tmp`` to ``final``, then point ``LATEST`` at it."""
    aside = None
    if os.path.exists(final):  # re-saving the same step: move the old one aside first
        aside = f"{final}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, aside)
    os.rename(tmp, final)
    _fsync_dir(directory)
    try:
        _write_atomic(os.path.join(directory, _LATEST), os.path.basename(final) + "\n")
    except OSError:  # not published after all: put everything back as it was
        with contextlib.suppress(OSError):
            os.rename(final, tmp)
            if aside is not None:
                os.rename(aside, final)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)

