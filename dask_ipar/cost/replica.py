"""The cost of in-memory redundancy: each grid cell's training state copied to a buddy.

Every ``every`` steps each cell snapshots its weight blocks and optimizer state (one local
copy, so later in-place updates cannot touch it) and sends the snapshot to its *buddy*
cell (:func:`buddy`): the next cell down its grid column, or along its row when the grid
has one row. A lost worker's state is then rebuilt from its buddy's copy, the others'
from their own (:mod:`dask_ipar.runtime.replicas`). One message per cell and refresh.

Pure Python, like the rest of :mod:`dask_ipar.cost`.
"""

from __future__ import annotations

from dask_ipar.cost.machine import Machine
from dask_ipar.cost.model import PhaseCost, _phase

__all__ = ["buddy", "state_words", "replica_phase", "replica_memory_bytes", "network_state_words",
           "REPLICA_LAYER", "REPLICA_PHASE", "GENERATIONS"]

#: The comm table's row of the replicas: layer ``state``, phase ``replica``.
REPLICA_LAYER, REPLICA_PHASE = "state", "replica"
#: Snapshots a process holds at most: the newest complete one and the one being made.
GENERATIONS = 2


def buddy(pr: int, pc: int, i: int, j: int) -> tuple[int, int] | None:
    """The cell holding cell ``(i, j)``'s replica: ``((i + 1) % Pr, j)``, or with one grid
    row ``(i, (j + 1) % Pc)``; None on a 1x1 grid.

    >>> buddy(2, 2, 1, 0), buddy(1, 4, 0, 3), buddy(1, 1, 0, 0)
    ((0, 0), (0, 0), None)
    """
    if pr > 1:
        return ((i + 1) % pr, j)
    if pc > 1:
        return (i, (j + 1) % pc)
    return None


def state_words(layers, pr: int, pc: int, slots: int) -> dict:
    """Words of each cell's training state: per layer its weight block (``rows[i]`` x
    ``wcols[j]`` ranges, bias column included) and ``slots`` optimizer arrays of the same
    shape (1: momentum, 2: Adam, 0: none). ``layers`` are ``(rows, wcols)`` pairs.

    >>> state_words([(((0, 5), (5, 9)), ((0, 4), (4, 8)))], 2, 2, 1)[(1, 1)]
    32
    """
    out = {}
    for i in range(pr):
        for j in range(pc):
            out[(i, j)] = sum((rows[i][1] - rows[i][0]) * (cols[j][1] - cols[j][0])
                              for rows, cols in layers) * (1 + slots)
    return out


def network_state_words(layers, pr: int, pc: int, slots: int) -> dict:
    """:func:`state_words` of a network's layer specs as the engine blocks their weights:
    ``rows`` the balanced split of the outputs over Pr, ``wcols`` of the inputs (a conv's
    ``C / groups * kh * kw``) plus the bias column over Pc; pooling layers have none."""
    from dask_ipar.cost.layers import FC, Conv2d
    from dask_ipar.layout.partition import split_bounds

    mats = []
    for layer in layers:
        if isinstance(layer, FC):
            n_out, n_in, bias = layer.d_out, layer.d_in, layer.bias
        elif isinstance(layer, Conv2d):
            n_out, n_in = layer.out_c, layer.in_c // layer.groups * layer.k_h * layer.k_w
            bias = getattr(layer, "bias", True)
        else:
            continue
        mats.append((split_bounds(n_out, pr), split_bounds(n_in + int(bias), pc)))
    return state_words(mats, pr, pc, slots)


def replica_phase(words: dict, pr: int, pc: int, machine: Machine) -> PhaseCost:
    """One refresh: every cell's state (``words`` per cell) to its buddy, one message each;
    the busiest receiver sets the time."""
    into: dict = {}
    total = 0
    for (i, j), n in words.items():
        b = buddy(pr, pc, i, j)
        if b is None:
            continue
        into[b] = into.get(b, 0) + n
        total += n
    if not into:
        return _phase(REPLICA_LAYER, REPLICA_PHASE, 1, 0, 0, 0, machine)
    w = machine.word_bytes
    busiest = max(into.values())
    msgs = max(sum(1 for c in words if buddy(pr, pc, *c) == b) for b in into)
    return _phase(REPLICA_LAYER, REPLICA_PHASE, 2, total * w, busiest * w, msgs, machine)


def replica_memory_bytes(words: dict, pr: int, pc: int, word_bytes: int) -> int:
    """Extra bytes on the busiest process: its own snapshot and the one it holds for its
    buddy, for :data:`GENERATIONS` refreshes."""
    per = {c: n for c, n in words.items()}
    held = dict.fromkeys(words, 0)
    for c, n in words.items():
        b = buddy(pr, pc, *c)
        if b is not None:
            held[b] += n
    return GENERATIONS * max(per[c] + held[c] for c in words) * word_bytes

