"""The worker side of a replayed step template: a cached program and its keys renamed.

Its one job: a :class:`Replay` is what a worker program's dask task gets when the client
replays a step template (:mod:`dask_ipar.runtime.templates`): the template's program,
pickled once on the client (``blob``, the same bytes every submission), how far its steps
are shifted, the submission's own tag and task key, and its batch blocks. The worker
unpickles a template's program once and keeps it (:meth:`Replay.open`, per process, the
:data:`WORKER_TEMPLATES` most recent); :class:`Rekey` renames the template's keys into
the submission's where blocks leave or enter the program (sent, received, returned,
recorded for the dashboard), while its tasks run on the template's keys.

A template key names the template's uid (the model's uid with :data:`MARK` appended) and
a step relative to the submission (0: the state it starts from, 1 to k: its steps):
``"dense0.act-0a1b2c3dT-s1"`` is ``"dense0.act-0a1b2c3d-s{shift + 1}"`` of the submission.
The state blocks (weights, momentum: ``"<layer>.<kind>-<tuid>-s0"``) are mapped to the
submission's names one by one (``Replay.fixed``), whatever those are: the last
submission's weights, the momentum named once for a run, the blocks of a lineage cut.
Other keys are the same in both.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["Replay", "Rekey", "MARK", "WORKER_TEMPLATES", "template_uid"]

#: Appended to a model's uid to name its template keys.
MARK = "T"
#: Template programs a worker process keeps unpickled (the least recently used go).
WORKER_TEMPLATES = 32

_opened: OrderedDict = OrderedDict()  # template id -> _Opened
_lock = threading.Lock()


def template_uid(uid: str) -> str:
    """The uid the template keys of model ``uid`` name."""
    return uid + MARK


class Rekey:
    """Template keys to a submission's keys: uid ``tuid`` becomes ``uid`` and each step
    ``s`` becomes ``s + shift``; ``fixed`` names the state blocks the submission starts
    from: template name -> the submission's (names cached: a program renames the same few
    hundred)."""

    __slots__ = ("mark", "uid", "shift", "names")

    def __init__(self, tuid: str, uid: str, shift: int, fixed=None):
        self.mark, self.uid, self.shift = f"-{tuid}-s", uid, shift
        self.names: dict = dict(fixed or {})

    def name(self, name):
        """``"<layer>.<task>-<tuid>-s<r>"`` as ``"<layer>.<task>-<uid>-s<r + shift>"``;
        other names unchanged."""
        out = self.names.get(name)
        if out is None:
            head, sep, tail = name.rpartition(self.mark) if isinstance(name, str) else ("", "", "")
            out = (f"{head}-{self.uid}-s{int(tail) + self.shift}"
                   if sep and tail.isdigit() else name)
            self.names[name] = out
        return out

    def key(self, key):
        """A key ``(name, *index)`` with its name renamed (:meth:`name`)."""
        if isinstance(key, tuple) and key and isinstance(key[0], str):
            name = self.name(key[0])
            return key if name is key[0] else (name, *key[1:])
        return key


class _Opened:
    """A template program unpickled on this worker, with what its runs can share
    (filled in by :func:`~dask_ipar.runtime.programs.run_program`)."""

    __slots__ = ("prog", "ready", "steps")

    def __init__(self, prog):
        self.prog, self.ready, self.steps = prog, None, None


class Replay:
    """One submission's run of a template program (see the module)."""

    __slots__ = ("tid", "blob", "tuid", "uid", "shift", "fixed", "tag", "key", "data")

    def __init__(self, tid: str, blob: bytes, tuid: str, uid: str, shift: int, fixed: dict,
                 tag: str, key: tuple, data: dict):
        self.tid, self.blob, self.tuid, self.uid = tid, blob, tuid, uid
        self.shift, self.fixed, self.tag, self.key, self.data = shift, fixed, tag, key, data

    def __reduce__(self):
        return (Replay, (self.tid, self.blob, self.tuid, self.uid, self.shift, self.fixed,
                         self.tag, self.key, self.data))

    def open(self):
        """``(opened template, Rekey)``: the template's program, unpickled at its first
        run on this worker and kept."""
        with _lock:
            opened = _opened.get(self.tid)
            if opened is not None:
                _opened.move_to_end(self.tid)
        if opened is None:
            from distributed.protocol.pickle import loads

            opened = _Opened(loads(self.blob))
            with _lock:
                opened = _opened.setdefault(self.tid, opened)
                while len(_opened) > WORKER_TEMPLATES:
                    _opened.popitem(last=False)
        return opened, Rekey(self.tuid, self.uid, self.shift, self.fixed)
