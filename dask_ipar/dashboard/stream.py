"""Worker programs in dask's own task stream: one bar per layer and phase, not per program.

A worker program (:mod:`dask_ipar.runtime.programs`) runs a whole step's kernels of one
worker inside one dask task, so dask's task stream (the dashboard's ``/status`` and
``/tasks`` pages, ``performance_report``, ``Client.get_task_stream``) would show it as one
long ``step.run0`` bar. When the ``/ipar`` page is installed, each program sends what it
did (its :class:`~dask_ipar.dashboard.recorder.TimelineRecorder` records) to the scheduler
when it ends, and :class:`~dask_ipar.dashboard.page.IparDashboard` puts bars in the task
stream in place of the program's bar, on the same worker lane:

* a kernel's bar is named ``<layer>.<phase>`` (``dense1.forward``, ``dense1.backward``,
  ``dense1.update``, ...) and coloured by that name, as dask colours task prefixes;
* a wait for a block is a ``transfer`` bar (dask's red) named after the collective that
  moves the block (``transfer-dense1.dw_reduce``), as dask draws the fetch of a task's
  inputs.

:func:`stream_groups` (pure, on the worker) turns a program's kernels and waits into
named, merged intervals; :func:`splice` (on the scheduler) replaces the
program's entry with them. The entry format is that of
``distributed.diagnostics.task_stream.TaskStreamPlugin`` (a private structure: see the
table in ``docs/concepts.md``).
"""

from __future__ import annotations

import functools

from dask_ipar.dashboard.timeline import layer_phase, uid_of_name

__all__ = ["STREAM_TOPIC", "MERGE_GAP_S", "stream_groups", "stream_entries", "splice",
           "find_entry"]

#: Event topic on which programs send their records to the scheduler.
STREAM_TOPIC = "dask-ipar-stream"
#: Kernels of the same layer and phase closer than this merge into one bar.
MERGE_GAP_S = 5e-4
#: How far back in the task stream a program's own entry is looked for.
SEARCH_BACK = 512


def stream_groups(records, rename=None) -> list:
    """``[[key, action, [[start, stop], ...]], ...]``: one program's ``records``
    (``[name, kind, start, stop]``) grouped by layer, phase and kind, in the order of
    their first interval; kernels of a group closer than :data:`MERGE_GAP_S` merge.
    ``rename``: applied to each group's ``"<layer>.<phase>-<uid>-s<step>"`` (a replayed
    template's records name its keys, :class:`~dask_ipar.runtime.replay.Rekey`).

    >>> stream_groups([["dense0.act-0a1b2c3d-s3", "compute", 1.0, 2.0],
    ...                ["dense0.act-0a1b2c3d-s3", "compute", 2.0001, 2.5],
    ...                ["dense0.dwp-0a1b2c3d-s3", "wait", 3.0, 3.5]])
    [['dense0.forward-0a1b2c3d-s3', 'compute', [[1.0, 2.5]]], ['dense0.dw_reduce-0a1b2c3d-s3-wait', 'transfer', [[3.0, 3.5]]]]
    """
    groups: dict = {}
    for name, kind, t0, t1 in sorted(records, key=_start):
        spans = groups.setdefault(_group(name, kind), [])
        if spans and t0 - spans[-1][1] < MERGE_GAP_S:
            spans[-1][1] = max(spans[-1][1], t1)
        else:
            spans.append([t0, t1])
    out = []
    for (key, wait), spans in groups.items():
        key = key if rename is None else rename(key)
        out.append([key + "-wait", "transfer", spans] if wait else [key, "compute", spans])
    return out


def _start(record):
    return record[2]


@functools.lru_cache(maxsize=8192)
def _group(name: str, kind: str) -> tuple:
    """``("<layer>.<phase>-<uid>-s<step>", is a wait)`` of a record (cached: a program's
    names repeat every submission)."""
    layer, phase = layer_phase(name, kind)
    return f"{layer}.{phase}-{uid_of_name(name)}-s{name.rpartition('-s')[2]}", kind == "wait"


def stream_entries(groups, worker: str, thread, delay: float = 0.0) -> list[dict]:
    """Task-stream entries of :func:`stream_groups` on lane ``(worker, thread)``;
    ``delay`` is added to the times, as dask adds a worker's scheduler delay to its
    tasks' start and stop."""
    return [{"key": key, "worker": worker, "thread": thread, "status": "OK",
             "startstops": [{"action": action, "start": a + delay, "stop": b + delay}
                            for a, b in spans]}
            for key, action, spans in groups]


def find_entry(buffer, key) -> dict | None:
    """The newest entry of ``key`` among the last :data:`SEARCH_BACK` of a task stream's
    ``buffer``, or None."""
    n = len(buffer)
    for i in range(n - 1, max(-1, n - 1 - SEARCH_BACK), -1):
        e = buffer[i]
        if e.get("key") == key:
            return e
    return None


def splice(task_stream, key, groups, delay: float = 0.0) -> bool:
    """Replace program ``key``'s entry in ``task_stream`` (dask's ``TaskStreamPlugin``)
    with the bars of :func:`stream_groups`; False when the entry is not (or no longer)
    there.

    The entry is rewritten in place and the others are appended, so the plugin's running
    index stays the count of entries ever added (what dask's dashboard reads by)."""
    entry = find_entry(task_stream.buffer, key)
    if entry is None or entry.get("status") != "OK" or "worker" not in entry:
        return False
    new = stream_entries(groups, entry["worker"], entry.get("thread"), delay)
    if not new:
        return False
    entry.clear()
    entry.update(new[0])
    task_stream.buffer.extend(new[1:])
    task_stream.index += len(new) - 1
    return True
