"""Bounded task history for long training.

Every training step's weights are computed from the step before, and dask keeps records
of finished tasks that lead to data still held:

- a worker keeps the record of every finished task whose result feeds a key it still
  holds, so while the current weights exist every past step's records stay (with the
  run spec of each embedded batch block); measured on a 2x2 grid of the tiny MLP:
  about 140 KB per step per worker (``benchmarks/long_run.py``, docs/concepts.md);
- the scheduler's spans keep every task group they ever held (dask/distributed#7977),
  and every step makes new groups (key names carry the step): 40-65 KB per step.

:func:`rekey_blocks` gives blocks new keys without history (the way scattered data has
none); :meth:`dask_ipar.runtime.state.BlockStore.cut_lineage` uses it once
``Sequential.lineage_steps`` steps have run since the last cut (at the first submission
that finds the state settled, at the latest after twice as many:
:func:`~dask_ipar.runtime.steps.submit_steps`), then
:func:`fold_finished_groups` folds the model's finished task groups into one per span
(span totals unchanged) and keeps one copy of each span's repeated collection
description. Both run inside the dask processes through ``client.run`` /
``client.run_on_scheduler``.

Both also empty dask's ``key_split`` cache in their process (:func:`clear_key_cache`): an
LRU of 100,000 key names that every new key enters, so with new names every step (they
carry the step) it grows about 300 bytes per name until full, some 30 MB per process,
reached only after 3,000 (scheduler) to 8,000 (workers) steps of a small model. Emptied at
each cut, the memory of a long run stays flat (``benchmarks/long_run.py --fit``); the cost
is recomputing the names of keys still in use (microseconds each).
"""

from __future__ import annotations

import time

from dask_ipar.errors import IparError

__all__ = ["missing_blocks", "rekey_blocks", "fold_finished_groups", "clear_key_cache"]


def clear_key_cache() -> None:
    """Empty dask's ``key_split`` cache (``functools.lru_cache``) in this process."""
    from dask.utils import key_split

    clear = getattr(key_split, "cache_clear", None)
    if clear is not None:
        clear()


def missing_blocks(renames: dict, dask_worker=None) -> list:
    """On a worker: the old keys of ``renames`` (see :func:`rekey_blocks`) it does not hold."""
    return [tuple(old) for old, _ in renames.get(dask_worker.address, ())
            if tuple(old) not in dask_worker.data]


def rekey_blocks(renames: dict, dask_worker=None) -> dict:
    """On a worker: store each block held under an old key under its new key as well,
    the way ``client.scatter`` stores data (no task, no history): the same array, not a
    copy. ``renames`` maps worker addresses to ``[(old_key, new_key), ...]``. Returns
    ``{new_key: nbytes}`` of this worker's blocks."""
    from dask.sizeof import sizeof

    data = {}
    for old, new in renames.get(dask_worker.address, ()):
        try:
            data[tuple(new)] = dask_worker.data[tuple(old)]
        except KeyError:
            raise IparError(
                f"worker {dask_worker.address} does not hold block {tuple(old)!r} any more "
                "(it was released or the worker restarted), so it cannot be re-keyed."
            ) from None
    dask_worker.update_data(data=data, stimulus_id=f"dask-ipar-rekey-{time.time()}")
    clear_key_cache()
    return {k: sizeof(v) for k, v in data.items()}


def _fold(into, tg) -> None:
    """Add task group ``tg``'s totals to ``into`` (both finished and forgotten)."""
    into.nbytes_total += tg.nbytes_total
    for state, n in tg.states.items():
        into.states[state] += n
    for action, us in tg._all_durations_us.items():
        into._all_durations_us[action] += us
    into._duration_us += tg._duration_us
    into._size += tg._size
    for typ, n in tg._types.items():
        into._types[typ] += n
    starts = [s for s in (into.start, tg.start) if s]
    into.start = min(starts) if starts else 0.0
    into.stop = max(into.stop, tg.stop)


def fold_finished_groups(token: str, dask_scheduler=None) -> int:
    """On the scheduler: in every span, fold the task groups whose name contains
    ``token`` and whose tasks are all forgotten into one of them, and drop the links
    those groups keep to others. A span's start, stop, duration, bytes and state counts
    are unchanged; its finished groups stop piling up. The span's list of computed
    collections (one identical entry per submission) keeps one entry of each. Returns
    how many groups were folded away; 0 where this dask has no spans or a different
    task-group layout (then nothing is changed)."""
    clear_key_cache()
    live = dask_scheduler.task_groups
    ext = dask_scheduler.extensions.get("spans")
    if ext is None:
        return 0

    def gone(tg):
        return token in tg.name and live.get(tg.name) is not tg and tg.done

    folded_into = {}
    try:
        for span in ext.spans.values():
            old = [tg for tg in span.groups if gone(tg)]
            if len(old) < 2:
                continue
            # one identical description per submission ({"type": "low-level-graph"})
            meta = span._metadata
            if meta and meta.get("collections"):
                distinct = []
                for c in meta["collections"]:
                    if c not in distinct:
                        distinct.append(c)
                meta["collections"] = distinct
            keep = old[0]
            keep.dependencies.clear()
            for tg in old[1:]:
                _fold(keep, tg)
                span.groups.discard(tg)
                folded_into[id(tg)] = keep
    except AttributeError:  # not the task-group layout this was written for
        return 0
    # the deprecated Computation objects (spans' predecessors) drop the folded groups:
    # their totals then cover the groups left, not the whole history
    for comp in getattr(dask_scheduler, "computations", ()):
        groups = getattr(comp, "groups", None)
        if groups:
            comp.groups = {tg for tg in groups if id(tg) not in folded_into}
    return len(folded_into)
