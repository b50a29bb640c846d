"""Alpha-beta costs of the collectives used by the paper and by the engine.

All functions return a :class:`CommCost` for the busiest process of one group
of ``p`` processes: ``messages`` received, ``nbytes`` received, and the time
split into a latency term (``alpha * messages``) and a bandwidth term
(``nbytes / bandwidth``).  A group of ``p = 1`` costs nothing.

Two algorithm families:

- ``"paper"`` (paper.md, Notation): all-gather by Bruck, ``alpha*ceil(log2 p)
  + beta*(p-1)/p*n``; ring all-reduce ``2*(alpha*ceil(log2 p) +
  beta*(p-1)/p*n)``.
- ``"direct"`` (the engine): every process exchanges one message with each of
  the ``p - 1`` others, so the latency term is ``alpha*(p-1)``; bandwidth terms
  are the same ``(p-1)/p*n``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dask_ipar.cost.machine import Machine

__all__ = [
    "CommCost",
    "ZERO_COST",
    "log2_ceil",
    "allgather_cost",
    "reduce_scatter_cost",
    "allreduce_cost",
    "alltoall_cost",
    "point_to_point_cost",
]

_ALGORITHMS = ("paper", "direct")


@dataclass(frozen=True)
class CommCost:
    """Cost of one communication step on the critical path (the busiest process).

    Attributes
    ----------
    messages : int
        Messages received by the busiest process.
    nbytes : float
        Bytes received by the busiest process.
    latency_s : float
        ``alpha * messages`` seconds.
    bandwidth_s : float
        ``nbytes / bandwidth_Bps`` seconds (``beta`` times words).
    """

    messages: int
    nbytes: float
    latency_s: float
    bandwidth_s: float

    @property
    def seconds(self) -> float:
        """Latency plus bandwidth time."""
        return self.latency_s + self.bandwidth_s

    def __add__(self, other: "CommCost") -> "CommCost":
        return CommCost(
            self.messages + other.messages,
            self.nbytes + other.nbytes,
            self.latency_s + other.latency_s,
            self.bandwidth_s + other.bandwidth_s,
        )

    def scaled(self, factor: int) -> "CommCost":
        """``factor`` repetitions of this step (e.g. 2 for a ring all-reduce)."""
        return CommCost(
            self.messages * factor, self.nbytes * factor, self.latency_s * factor, self.bandwidth_s * factor
        )


ZERO_COST = CommCost(0, 0.0, 0.0, 0.0)


def log2_ceil(p: int) -> int:
    """``ceil(log2 p)`` for a positive integer ``p`` (0 for ``p = 1``)."""
    if p < 1:
        raise ValueError(f"p: got {p!r}; expected a positive process count")
    return (p - 1).bit_length()


def _check(p: int, nbytes: float, algorithm: str) -> None:
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"p: got {p!r}; expected a positive integer number of processes")
    if not nbytes >= 0:
        raise ValueError(f"nbytes: got {nbytes!r}; expected a non-negative byte count")
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"algorithm: got {algorithm!r}; expected one of {_ALGORITHMS}")


def _cost(messages: int, nbytes: float, machine: Machine) -> CommCost:
    return CommCost(messages, float(nbytes), machine.alpha_s * messages, nbytes / machine.bandwidth_Bps)


def allgather_cost(p: int, result_bytes: float, machine: Machine, *, algorithm: str = "paper") -> CommCost:
    """All-gather over ``p`` processes whose gathered result has ``result_bytes``.

    ``alpha*ceil(log2 p) + beta*(p-1)/p*n`` (paper.md, Notation; Bruck), or
    ``alpha*(p-1) + beta*(p-1)/p*n`` for ``algorithm="direct"``.
    """
    _check(p, result_bytes, algorithm)
    if p == 1:
        return ZERO_COST
    messages = log2_ceil(p) if algorithm == "paper" else p - 1
    return _cost(messages, (p - 1) / p * result_bytes, machine)


def reduce_scatter_cost(p: int, input_bytes: float, machine: Machine, *, algorithm: str = "paper") -> CommCost:
    """Reduce-scatter over ``p`` processes of a full-size input of ``input_bytes``.

    Same volume as an all-gather of the result: ``alpha*ceil(log2 p) +
    beta*(p-1)/p*n`` (half of the paper's ring all-reduce), or ``alpha*(p-1)``
    latency for ``algorithm="direct"``.
    """
    return allgather_cost(p, input_bytes, machine, algorithm=algorithm)


def allreduce_cost(p: int, nbytes: float, machine: Machine, *, algorithm: str = "paper") -> CommCost:
    """All-reduce of ``nbytes`` over ``p`` processes.

    Ring (paper.md, Notation): ``2*(alpha*ceil(log2 p) + beta*(p-1)/p*n)``;
    reduce-scatter then all-gather.  ``"direct"`` uses ``alpha*(p-1)`` per half.
    """
    return reduce_scatter_cost(p, nbytes, machine, algorithm=algorithm).scaled(2)


def alltoall_cost(p: int, local_bytes: float, machine: Machine, *, algorithm: str = "paper") -> CommCost:
    """All-to-all over ``p`` processes, each holding ``local_bytes`` and keeping 1/p.

    ``alpha*ceil(log2 p) + beta*(p-1)/p*local`` (Bruck-style latency; a lower
    bound on the bandwidth term), or ``alpha*(p-1)`` latency for ``"direct"``.
    """
    return allgather_cost(p, local_bytes, machine, algorithm=algorithm)


def point_to_point_cost(nbytes: float, machine: Machine, *, messages: int = 1) -> CommCost:
    """Point-to-point exchange (halo, Eq. 7): ``messages*alpha + beta*n``.

    Zero bytes means no message at all (e.g. 1 x 1 kernels need no halo).
    """
    if not nbytes >= 0:
        raise ValueError(f"nbytes: got {nbytes!r}; expected a non-negative byte count")
    if nbytes == 0 or messages == 0:
        return ZERO_COST
    return _cost(messages, nbytes, machine)
