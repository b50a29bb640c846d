"""Machine model: latency, bandwidth, word size and compute rate.

The alpha-beta model of Gholami et al. (SPAA 2018) charges ``alpha`` seconds
per message and ``beta`` seconds per word.  Here bandwidth is given in bytes
per second, so ``beta = word_bytes / bandwidth_Bps`` seconds per word.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = [
    "ELEMENTWISE_BLOCKS",
    "Machine",
    "block_weight",
    "PAPER_MACHINE",
    "LOOPBACK_MACHINE",
    "parse_bytes",
    "parse_bandwidth",
    "load_machine",
    "save_machine",
]

#: The largest array of a kernel, in bytes, that ``elementwise_Bps`` and
#: ``elementwise_large_Bps`` stand for where a machine gives both (the kernel mix of
#: ``dask-ipar calibrate`` at its two sizes before session 52: conv blocks of 16 and of 64
#: images of 32 x 32 x 64; it now reads one rate, on the large size)
ELEMENTWISE_BLOCKS = (4 * 2**20, 16 * 2**20)


def block_weight(block_bytes: float) -> float:
    """How far a kernel whose largest array holds ``block_bytes`` lies from the small
    block of :data:`ELEMENTWISE_BLOCKS` to the large one, in the logarithm of the size
    (0 at or below the small one, 1 at or above the large one)."""
    lo, hi = ELEMENTWISE_BLOCKS
    if block_bytes <= lo:
        return 0.0
    if block_bytes >= hi:
        return 1.0
    return math.log(block_bytes / lo) / math.log(hi / lo)


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    # bits
    "bit": 1 / 8,
    "kbit": 10**3 / 8,
    "mbit": 10**6 / 8,
    "gbit": 10**9 / 8,
    "tbit": 10**12 / 8,
    "kibit": 2**10 / 8,
    "mibit": 2**20 / 8,
    "gibit": 2**30 / 8,
}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: str | float | int, *, name: str = "value") -> float:
    """Parse a byte count such as ``"6GiB"``, ``"125MB"``, ``"1Gbit"`` or ``4e9``.

    Parameters
    ----------
    value : str, float or int
        A number of bytes, optionally with a decimal (kB, MB, GB, TB), binary
        (KiB, MiB, GiB, TiB) or bit (bit, kbit, Mbit, Gbit) suffix.  Units are
        case-insensitive; ``"b"`` alone means bytes.
    name : str
        Argument name used in error messages.

    Returns
    -------
    float
        Number of bytes (may be fractional for bit units).

    Examples
    --------
    >>> parse_bytes("6GiB")
    6442450944.0
    >>> parse_bytes("1Gbit")
    125000000.0
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}: got {value!r}; expected a byte count such as 6GiB or 125MB")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        text = str(value).strip()
        if text.lower().endswith("/s"):
            text = text[:-2]
        match = _NUMBER_UNIT.match(text)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{name}: could not parse {value!r}; expected a number with an optional unit "
                "such as 6GiB, 125MB, 1Gbit or 6.4e9 (units: B, kB, MB, GB, TB, KiB, MiB, "
                "GiB, TiB, bit, kbit, Mbit, Gbit)"
            )
        number = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name}: got {value!r}; expected a finite non-negative byte count")
    return number


def parse_bandwidth(value: str | float | int, *, name: str = "bandwidth") -> float:
    """Parse a bandwidth in bytes per second (``"6GiB"``, ``"6GiB/s"``, ``"10Gbit"``).

    Raises ``ValueError`` when the bandwidth is not strictly positive.
    """
    number = parse_bytes(value, name=name)
    if number <= 0:
        raise ValueError(f"{name}: got {value!r}; expected a positive bandwidth such as 6GiB")
    return number


@dataclass(frozen=True)
class Machine:
    """Alpha-beta machine description.

    Parameters
    ----------
    alpha_s : float
        Latency per message, seconds (the paper's alpha).
    bandwidth_Bps : float
        Point-to-point bandwidth, bytes per second (``1/beta`` times the word size).
    word_bytes : int
        Bytes per word (4 for float32, as in the paper).
    compute_s_per_iter : float, optional
        Measured compute time of one iteration (the paper's convention: measured
        once and reused for every grid of the same P and B).
    flops_per_s : float, optional
        Sustained flop rate of one process; used when ``compute_s_per_iter``
        is not given: compute = flops / (P * flops_per_s).
    cluster_flops_per_s : float, optional
        Matmul rate of all the workers computing at once (what processes that
        share cores get together); the step-time simulation's throughput bound.
    task_s : float, optional
        Seconds the cluster needs per task when it runs many small tasks at once
        (scheduler, worker and client work per task, on the shared cores).
    cluster_bandwidth_Bps : float, optional
        Bytes per second the workers move together when all of them transfer at once.
    mem_Bps : float, optional
        Bytes per second of elementwise work into fresh arrays, all workers at once
        (allocation and page faults included, as the engine's kernels pay them).
    message_s : float, optional
        One-way latency of a small block between worker programs (half a 4-byte ping-pong
        over their transport): what a remote input adds to a step run as programs, where
        ``alpha_s`` is a dask task hop.
    round_s : float, optional
        A graph of one small task per worker submitted and its results gathered: the
        fixed cost a step run as worker programs pays outside them.
    transfer_cpu_s_per_B : float, optional
        CPU seconds a worker spends per byte it sends or receives (the transport's copies
        and system calls, measured while every worker transfers at once, 112 MiB each at
        least, and computes beside it, since session 53: a transport whose cores compute is
        woken less often and reads larger pieces): what moving a block takes from the
        computing when worker processes share a machine's cores.
    elementwise_Bps : float, optional
        Bytes per second of the kernels' element-wise work as the step-time model counts
        it (the engine's own kernels on one worker, their flops' time taken off;
        ``dask-ipar calibrate`` runs them on blocks that stream from memory, 16 MiB); the
        model's fixed default where None.
    elementwise_large_Bps : float, optional
        Where given (a machine file's; ``dask-ipar calibrate`` measured it before session
        52 and no longer does): the same for kernels whose largest array holds the large
        size of :data:`ELEMENTWISE_BLOCKS` or more (16 MiB), ``elementwise_Bps`` then
        standing for its small size or less (4 MiB); between the two, the seconds per byte
        go linearly with the logarithm of the block's size (:meth:`elementwise_s_per_B`).
        One rate for every size where None.
    exchange_Bps : float, optional
        Bytes per second one worker sends while every worker sends to every other at once
        (a collective's per-link rate); the step-time model's link rate where below
        ``bandwidth_Bps``.
    busy_exchange_Bps : float, optional
        The same while every worker also runs the engine's kernels beside it: a
        link's rate while a step's kernels fill the cores, where the transports wait for
        them (emulated 1 Gbit/s hosts sharing 2 cores: 0.75-0.85 of ``exchange_Bps`` on
        4, 0.64 on 8); the step-time model's link rate while as many kernels run as there
        are cores.
    loaded_message_s : float, optional
        ``message_s`` while every link carries an all-to-all's large blocks (half a 4-byte
        ping-pong's round trip beside it): a small block waits behind the bytes the links'
        queues hold (3-7 ms on emulated 1 Gbit/s hosts, against 0.06 ms idle).
    direct_message_cpu_s, message_cpu_s : float, optional
        CPU seconds a worker's transport spends per message on each end beyond
        ``transfer_cpu_s_per_B`` (framing, system calls, event-loop turns): a small message
        (at most 64 KiB, which the sending program writes into the direct link itself) and
        a larger one (handed to the direct link's thread, or to dask's comms where the
        workers have no direct links).
    step_cpu_s : float, optional
        CPU seconds per worker that one submitted training step costs outside its worker
        programs' loops: the scheduler's and the client's work for its dask tasks, its
        batch and its results, the workers' event loops', and dask running each program
        and the program's setup (real steps of a small network with a scattered batch;
        11-24 ms per worker on 2 to 8 local and emulated workers sharing 2 cores);
        where the workers share cores, the step-time model takes it from them at each
        submission's start.
    background_cores : float, optional
        Cores' worth of CPU that the cluster's processes take outside the tasks while the
        workers compute, over the whole cluster (the workers' event loops, heartbeats and
        dask's profiler, the scheduler, the client: 0.066, 0.09 and 0.12 on 2, 4 and 8
        emulated hosts sharing 2 cores); where the workers share cores, the step-time
        model leaves them ``cores - background_cores``.
    gemm_edge_flops : float, optional
        What a thin product costs beyond its flops: flop-equivalents (at ``flops_per_s``,
        the rate of a square 1024 product) per element of a product's edge, the elements of
        its operands and result beyond those of a square 1024 product of the same flops
        (:func:`dask_ipar.kernels.cost_shapes.gemm`): a product of ``m x k`` by ``k x n``
        costs ``2mkn + gemm_edge_flops * (mk + kn + mn - 2mkn * 3 / 2048)``. Measured by
        ``dask-ipar calibrate`` from the all-workers rates of a square and a thin product
        (OpenBLAS and MKL, 8 one-thread processes on 2 cores: a 4096 x 4096 x 128 product at
        0.82 of the square's rate, 88-96; the calibration's 2048 x 2048 x 128 at 0.89-0.93,
        26-43); 0 (every product at the square's rate) where
        None. Below ``2048 / 3``, where the largest products would cost nothing.
    program_task_cpu_s : float, optional
        CPU seconds a worker program's own loop spends per task beyond the task's kernel
        and the transports' work (finding the next task, its inputs, dropping blocks no
        longer read: the Python between the kernels), measured by ``dask-ipar calibrate``
        in real steps of a small network (:mod:`dask_ipar.runtime.stepprobe`; 19-34 us on
        local and emulated clusters of 2 to 8 workers sharing 2 cores); the step-time
        model adds it to every task of a step run as programs. 0 where None.
    conv_Bps : float, optional
        ``elementwise_Bps`` of the conv front's strided kernels alone (im2col gathers,
        col2im slice-adds, pooling windows: :data:`dask_ipar.kernels.conv_costs.CONV_KERNELS`),
        read by ``dask-ipar calibrate`` from those kernels' own calls in the kernel mix (a
        loopback worker of a 2-core AMD EPYC: 0.98 of the whole mix's rate); the step model
        prices these kernels' bytes at it, at every block size. ``elementwise_Bps`` (by
        size) where None.
    stack_cpu_s_per_B : float, optional
        CPU seconds per byte crossing the workers' transports (each end counted, as
        ``transfer_cpu_s_per_B``) of the network stack's work that lands on the computing:
        the operating system handles a packet on whatever runs where it comes, so a kernel
        that runs while blocks arrive spends part of its time in the OS kernel, outside
        ``transfer_cpu_s_per_B``. Read by ``dask-ipar calibrate`` in the exchanges beside
        computing, as the computing threads' time in the OS kernel over the bytes
        (:func:`dask_ipar.runtime.linkprobe.busy_exchange`; 8 emulated hosts sharing 2
        cores: 0.10-0.16 ns at 1 Gbit/s, 0.01-0.02 at 10); the step model adds it to the
        transports' CPU per byte where worker processes share cores. 0 where None.
    """

    alpha_s: float = 2e-6
    bandwidth_Bps: float = 6 * 2**30
    word_bytes: int = 4
    compute_s_per_iter: float | None = None
    flops_per_s: float | None = None
    cluster_flops_per_s: float | None = None
    task_s: float | None = None
    mem_Bps: float | None = None
    cluster_bandwidth_Bps: float | None = None
    message_s: float | None = None
    round_s: float | None = None
    transfer_cpu_s_per_B: float | None = None
    elementwise_Bps: float | None = None
    exchange_Bps: float | None = None
    direct_message_cpu_s: float | None = None
    message_cpu_s: float | None = None
    busy_exchange_Bps: float | None = None
    loaded_message_s: float | None = None
    step_cpu_s: float | None = None
    background_cores: float | None = None
    elementwise_large_Bps: float | None = None
    gemm_edge_flops: float | None = None
    program_task_cpu_s: float | None = None
    conv_Bps: float | None = None
    stack_cpu_s_per_B: float | None = None

    def __post_init__(self):
        if not (isinstance(self.alpha_s, (int, float)) and math.isfinite(self.alpha_s) and self.alpha_s >= 0):
            raise ValueError(f"alpha_s: got {self.alpha_s!r}; expected a non-negative latency in seconds, e.g. 2e-6")
        if not (isinstance(self.bandwidth_Bps, (int, float)) and self.bandwidth_Bps > 0 and math.isfinite(self.bandwidth_Bps)):
            raise ValueError(
                f"bandwidth_Bps: got {self.bandwidth_Bps!r}; expected a positive number of bytes/s, "
                "e.g. parse_bandwidth('6GiB')"
            )
        if isinstance(self.word_bytes, bool) or not isinstance(self.word_bytes, int) or self.word_bytes < 1:
            raise ValueError(f"word_bytes: got {self.word_bytes!r}; expected a positive integer such as 4 (float32)")
        for field in ("compute_s_per_iter", "flops_per_s", "cluster_flops_per_s", "task_s",
                      "mem_Bps", "cluster_bandwidth_Bps", "message_s", "round_s",
                      "transfer_cpu_s_per_B", "elementwise_Bps", "exchange_Bps",
                      "direct_message_cpu_s", "message_cpu_s", "busy_exchange_Bps",
                      "loaded_message_s", "step_cpu_s", "background_cores",
                      "elementwise_large_Bps", "gemm_edge_flops", "program_task_cpu_s",
                      "conv_Bps", "stack_cpu_s_per_B"):
            v = getattr(self, field)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{field}: got {v!r}; expected a non-negative number or None")
        if self.flops_per_s == 0:
            raise ValueError("flops_per_s: got 0; expected a positive flop rate or None")
        if self.gemm_edge_flops is not None and self.gemm_edge_flops >= 2048 / 3:
            raise ValueError(f"gemm_edge_flops: got {self.gemm_edge_flops!r}; expected below "
                             f"{2048 / 3:.1f} (flop-equivalents per element of a product's "
                             "edge; 'dask-ipar calibrate' measures it, tens on CPUs)")

    def elementwise_s_per_B(self, block_bytes: float, default_Bps: float,
                            turns: float = 1.0, kind: str = "") -> float:
        """Seconds per byte of the kernels' element-wise work in a kernel whose largest array
        holds ``block_bytes`` (``default_Bps`` where the machine has no ``elementwise_Bps``;
        see ``elementwise_large_Bps``). ``turns``: the worker processes that take turns on
        each core (workers over cores, where more): between a kernel and the next one of
        its process the others' blocks go through the caches, so a block is priced as one
        of ``turns`` times its bytes (the rates were measured on one worker alone); it
        only matters with ``elementwise_large_Bps`` (a machine file's: a calibration reads
        one rate, on blocks that stream from memory). ``kind``: a kernel's
        :func:`dask_ipar.kernels.costs.kernel_kind`; ``"conv"`` takes ``conv_Bps`` where
        measured, at every size."""
        if kind == "conv" and self.conv_Bps:
            return 1.0 / self.conv_Bps
        small = self.elementwise_Bps or default_Bps
        if not self.elementwise_large_Bps:
            return 1.0 / small
        w = block_weight(block_bytes * max(1.0, turns))
        return (1.0 - w) / small + w / self.elementwise_large_Bps

    @property
    def beta_s_per_byte(self) -> float:
        """Seconds per byte, ``1 / bandwidth_Bps``."""
        return 1.0 / self.bandwidth_Bps

    @property
    def beta_s_per_word(self) -> float:
        """The paper's beta: seconds per word, ``word_bytes / bandwidth_Bps``."""
        return self.word_bytes / self.bandwidth_Bps

    def compute_s(self, flops: float, procs: int) -> float:
        """Compute time of one iteration on ``procs`` processes.

        ``compute_s_per_iter`` when given (the paper's measured constant), else
        ``flops / (procs * flops_per_s)``, else 0 (communication only).
        """
        if self.compute_s_per_iter is not None:
            return float(self.compute_s_per_iter)
        if self.flops_per_s is not None:
            return flops / (procs * self.flops_per_s)
        return 0.0

    def replace(self, **changes) -> "Machine":
        """Return a copy with some fields changed."""
        data = asdict(self)
        data.update(changes)
        return Machine(**data)


PAPER_MACHINE = Machine(alpha_s=2e-6, bandwidth_Bps=6 * 2**30, word_bytes=4)
"""The simulated machine of the paper: alpha = 2 us, 1/beta = 6 GiB/s, 4-byte words; the
default of ``dask-ipar plan``."""

LOOPBACK_MACHINE = Machine(alpha_s=1e-3, bandwidth_Bps=1e9, word_bytes=4)
"""Rough alpha-beta figures for worker processes on one host (loopback TCP): the default of
a run's comm table and of ``dask-ipar train --conv auto``, which prints it; ``dask-ipar
calibrate`` measures the real ones."""

_MACHINE_KEYS = ("alpha_s", "bandwidth_Bps", "word_bytes", "flops_per_s", "compute_s_per_iter",
                 "cluster_flops_per_s", "task_s", "mem_Bps", "cluster_bandwidth_Bps",
                 "message_s", "round_s", "transfer_cpu_s_per_B", "elementwise_Bps",
                 "exchange_Bps", "direct_message_cpu_s", "message_cpu_s",
                 "busy_exchange_Bps", "loaded_message_s", "step_cpu_s", "background_cores",
                 "elementwise_large_Bps", "gemm_edge_flops", "program_task_cpu_s", "conv_Bps",
                 "stack_cpu_s_per_B")


def load_machine(path: str | Path) -> Machine:
    """Load a YAML machine file.

    Keys: ``alpha_s``, ``bandwidth_Bps`` (a number or a string such as
    ``"6GiB"``), ``word_bytes``, ``flops_per_s``, ``compute_s_per_iter``,
    ``cluster_flops_per_s``, ``task_s``, ``mem_Bps``, ``cluster_bandwidth_Bps``,
    ``message_s``, ``round_s``, ``transfer_cpu_s_per_B``, ``elementwise_Bps``,
    ``exchange_Bps``, ``direct_message_cpu_s``, ``message_cpu_s``, ``busy_exchange_Bps``,
    ``loaded_message_s``, ``step_cpu_s``, ``background_cores``, ``elementwise_large_Bps``,
    ``gemm_edge_flops``, ``program_task_cpu_s``, ``conv_Bps``, ``stack_cpu_s_per_B``.
    Missing keys take the paper machine's values.
    """
    import yaml  # lazy: only needed for machine files

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ValueError(f"machine file: cannot read {str(path)!r} ({exc.strerror}); give an existing YAML file") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"machine file: {str(path)!r} is not valid YAML ({exc}); fix the syntax") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"machine file: {str(path)!r} holds a {type(data).__name__}; expected a mapping of {', '.join(_MACHINE_KEYS)}")
    unknown = sorted(set(data) - set(_MACHINE_KEYS))
    if unknown:
        raise ValueError(f"machine file: unknown keys {unknown} in {str(path)!r}; allowed keys are {', '.join(_MACHINE_KEYS)}")
    if "bandwidth_Bps" in data and isinstance(data["bandwidth_Bps"], str):
        data["bandwidth_Bps"] = parse_bandwidth(data["bandwidth_Bps"], name="bandwidth_Bps")
    return Machine(**data)


def save_machine(machine: Machine, path: str | Path) -> None:
    """Write ``machine`` as a YAML machine file readable by :func:`load_machine`."""
    import yaml

    data = {k: getattr(machine, k) for k in _MACHINE_KEYS if getattr(machine, k) is not None}
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
