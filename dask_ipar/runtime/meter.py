"""Measuring what the engine really moves, beside what the cost model predicts.

Every worker logs each dependency it fetched (``transfer_incoming_log``:
sender, keys and their ``sizeof`` bytes, duration), and each block its worker programs
pushed to another worker (:mod:`dask_ipar.runtime.exchange`, the same fields). :class:`CommMeter`
drains those logs on every step (after widening them so that nothing is
dropped by the ``distributed.admin.low-level-log-length`` cap), attributes
each key to its layer and phase by its name (:func:`dask_ipar.nn.graph.phase_of_key`),
and compares the totals with :func:`dask_ipar.cost.dense_layer_phases` for
the same model, grid and batches.

Measured bytes are payload bytes as dask's ``sizeof`` reports them (exact for
NumPy blocks); the wire adds a few hundred bytes of framing per message.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field

from dask_ipar.cost import (FC, LOOPBACK_MACHINE, Machine, batch_layer_phases,
                            dense_layer_phases, engine_alltoall_phases, engine_model_conv_phases,
                            grad_norm_phase, redistribute_phase, row_parallel_phases,
                            window_halo_phases)
from dask_ipar.dashboard.render import fmt_ms
from dask_ipar.nn.graph import phase_of_key

__all__ = ["CommMeter", "CommRow", "CommReport", "predict_step", "summarize_transfers"]


#: Log length set on the workers: far more than a step moves; drained every 32 steps.
WIDE_LOG = 1_000_000


def _widen_logs(maxlen, dask_worker=None):
    from collections import deque

    for attr in ("transfer_incoming_log", "transfer_outgoing_log"):
        old = getattr(dask_worker, attr)
        if old.maxlen is not None and old.maxlen < maxlen:
            setattr(dask_worker, attr, deque(old, maxlen=maxlen))
    return dask_worker.transfer_incoming_log.maxlen


def _drain_logs(dask_worker=None) -> dict:
    """Pop every transfer entry (what dask fetched to this worker, and what this worker's
    programs pushed to others: :mod:`dask_ipar.runtime.exchange`, logged by the sender)
    and sum them here: ``{(sender, receiver, (layer, phase) or None): [bytes, seconds]}``,
    an entry's duration shared among its keys by their bytes. Summed on the worker, not
    sent entry by entry: a tiny MLP's 32 steps log thousands of small transfers, and
    serializing them one by one cost each worker about 1 ms a step."""
    from dask_ipar.runtime.exchange import drain_exchange_log

    entries = []
    log = dask_worker.transfer_incoming_log
    while log:
        e = log.popleft()
        entries.append((e["who"], dask_worker.address, e["duration"], e["keys"].items()))
    dask_worker.transfer_outgoing_log.clear()
    return summarize_transfers(entries + drain_exchange_log(dask_worker=dask_worker))


def summarize_transfers(entries) -> dict:
    """``(sender, receiver, duration_s, [(key, nbytes), ...])`` entries summed per sender,
    receiver and layer phase (None: keys of no layer phase): ``{(sender, receiver, lp):
    [bytes, seconds]}``, each entry's seconds shared among its keys by their bytes."""
    out: dict = {}
    for sender, receiver, duration, keys in entries:
        keys = list(keys)
        total = sum(n for _, n in keys) or 1
        for key, nbytes in keys:
            acc = out.setdefault((sender, receiver, phase_of_key(key)), [0, 0.0])
            acc[0] += nbytes
            acc[1] += duration * nbytes / total
    return out


@dataclass(frozen=True)
class CommRow:
    """Predicted beside measured communication of one phase of one layer, per step."""

    layer: str
    phase: str
    predicted_bytes: float
    measured_bytes: float
    predicted_s: float
    measured_s: float

    @property
    def ratio(self) -> float:
        """measured / predicted bytes (1.0 when both are zero)."""
        if self.predicted_bytes == 0:
            return 1.0 if self.measured_bytes == 0 else float("inf")
        return self.measured_bytes / self.predicted_bytes

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class CommReport:
    """Per-step averages over a run; ``rows`` in layer and phase order."""

    steps: int
    rows: list[CommRow] = field(default_factory=list)
    sent_bytes: dict = field(default_factory=dict)  # worker -> bytes sent over the run
    received_bytes: dict = field(default_factory=dict)  # worker -> bytes received
    sent_by_phase: dict = field(default_factory=dict)  # (layer, phase) -> {worker: bytes}
    received_by_phase: dict = field(default_factory=dict)  # (layer, phase) -> {worker: bytes}
    unattributed_bytes: int = 0
    #: worker -> bytes it read from storage over the run (data the cells read themselves)
    storage_read_bytes: dict = field(default_factory=dict)
    #: the data a step takes in, outside the workers' traffic: ``input client`` (bytes the
    #: client sends), ``input storage`` (bytes the cells read from storage)
    input_rows: list = field(default_factory=list)

    def table(self) -> str:
        """A plain-text table: one row per layer and phase."""
        head = (f"{'layer':<9}{'phase':<12}{'predicted B':>14}{'measured B':>14}{'ratio':>8}"
                f"{'pred ms':>10}{'meas ms':>10}")
        lines = [f"communication per step (mean of {self.steps} steps)", head]
        for r in self.rows:
            lines.append(
                f"{r.layer:<9}{r.phase:<12}{r.predicted_bytes:>14.0f}{r.measured_bytes:>14.0f}"
                f"{r.ratio:>8.3f}{fmt_ms(r.predicted_s):>10}{fmt_ms(r.measured_s):>10}"
            )
        for r in self.input_rows:
            lines.append(f"{r.layer:<9}{r.phase:<12}{r.predicted_bytes:>14.0f}"
                         f"{r.measured_bytes:>14.0f}{r.ratio:>8.3f}")
        if self.storage_read_bytes:
            per = sorted(self.storage_read_bytes.values())
            lines.append(f"(storage reads per cell over the run: {per[0]} to {per[-1]} bytes)")
        if self.unattributed_bytes:
            lines.append(f"(+ {self.unattributed_bytes} bytes of keys outside any layer phase)")
        return "\n".join(lines)


def predict_step(engine, pr, pc, batch, machine, word_bytes, grad_clip=False):
    """Cost-model phases of one training step of ``engine``'s layers (engine convention).

    Dense layers: Eq. 8. Conv and pooling layers on strips (domain-parallel): the halo
    exchanges of their exact window geometry, the all-to-all from a batch layout in front
    and, for convs, the weight all-reduce over all P; batch-parallel convs: that
    all-reduce alone; model-parallel convs: the gather of whole images, the filters'
    weight phases and the input-gradient reduce-scatter; then the flatten redistribution
    (Eq. 6). Every formula is :mod:`dask_ipar.cost`'s, on the layers' plain shapes, so
    :func:`dask_ipar.cost.price_assignment` prices the same network identically. With
    ``grad_clip``, the global norm's one-word all-reduce (:func:`grad_norm_phase`) too.
    """
    m = Machine(alpha_s=machine.alpha_s, bandwidth_Bps=machine.bandwidth_Bps,
                word_bytes=word_bytes)
    out = []
    front = engine.front
    if front is not None:
        prev = None
        for f in front.layouts:
            c, h, w = f.in_shape
            if f.layout == "model":
                if f.kind == "conv":  # filters over Pr, whole images; pooling is local
                    wl = f.weights
                    out.extend(engine_model_conv_phases(
                        f.name, c * h * w, wl.n_in, wl.n_out, wl.bias, pr, pc, batch, m,
                        prev_name=None if prev is None else prev.name,
                        prev_layout=None if prev is None else prev.layout))
                prev = f
                continue
            if f.layout == "batch":
                if f.kind == "conv":  # whole images, weights all-reduced over all P
                    out.extend(batch_layer_phases(FC(f.weights.n_in, f.weights.n_out,
                                                     bias=f.weights.bias), pr * pc, m,
                                                  name=f.name))
                prev = f
                continue
            if prev is not None and prev.layout == "batch":  # samples <-> strips, both ways
                out.extend(engine_alltoall_phases(f.name, h, c * w, pr, pc, batch, m))
            prev = f
            # the first layer needs no input gradient: no ghost rows go back
            out.extend(window_halo_phases(f.name, h, c * w, f.k[0], f.stride, f.pad[:2], pr, pc,
                                          batch, m, first_layer=f is front.layouts[0]))
            if f.kind == "conv":
                out.extend(batch_layer_phases(FC(f.weights.n_in, f.weights.n_out,
                                                 bias=f.weights.bias), pr * pc, m, name=f.name))
        c, h, w = front.out_shape
        out.append(redistribute_phase(c * h * w, pr, pc, batch, m, name=front.flatten))
    rowpar = engine.row_parallel(batch)  # the last layer on the rows each cell holds
    last = len(engine.layouts) - 1
    for k, lay in enumerate(engine.layouts):
        fc = FC(lay.n_in, lay.n_out, bias=lay.bias)
        if rowpar and k == last:
            out.extend(row_parallel_phases(fc, pr, pc, batch, m, name=lay.name))
            continue
        out.extend(dense_layer_phases(fc, pr, pc, batch, m,
                                      first_layer=k == 0 and front is None, convention="engine",
                                      name=lay.name, gather_output=not (rowpar and k == last - 1)))
    if grad_clip:
        out.append(grad_norm_phase(pr * pc, m))
    return out


class CommMeter:
    """Accumulates measured transfers and predicted phases over the steps of a run."""

    def __init__(self, client, binding, engine, word_bytes, machine: Machine | None = None,
                 grad_clip: bool = False, inputs=None, labels=None):
        self.client = client
        #: data the cells read themselves (:mod:`dask_ipar.io.lazy`), else None: in memory
        self.inputs, self.labels = inputs, labels
        self.grad_clip = grad_clip
        self.workers = list(binding.workers)
        self.grid = binding.grid
        self.engine = engine
        self.word_bytes = word_bytes
        self.machine = machine or LOOPBACK_MACHINE
        self._phases: dict = {}
        self._inputs_pred: dict = {}  # batch -> predicted (client, storage) bytes
        client.run(_widen_logs, WIDE_LOG, workers=self.workers)
        self.reset()

    def rebind(self, binding, engine=None):
        """Follow the model to the workers of ``binding`` (after a recovery re-bound it to
        a replacement worker, or to a smaller grid with its new ``engine``): their transfer
        logs are widened and drained from now on, and the steps after it are predicted on
        the new grid."""
        new = [w for w in binding.workers if w not in self.workers]
        self.workers = list(binding.workers)
        if engine is not None and binding.grid != self.grid:
            self.grid, self.engine = binding.grid, engine
            self._phases.clear()
            self._inputs_pred.clear()
        if new:
            self.client.run(_widen_logs, WIDE_LOG, workers=new)

    def reset(self):
        """Forget everything measured so far (and whatever the logs hold now)."""
        self.drain(record=False)
        self.steps = 0
        self._pred = defaultdict(lambda: [0.0, 0.0])  # (layer, phase) -> [bytes, seconds]
        self._bytes = defaultdict(int)
        self._secs = defaultdict(float)  # (layer, phase, receiver) -> seconds
        self._sent = defaultdict(int)
        self._recv = defaultdict(int)
        self._sent_phase = defaultdict(lambda: defaultdict(int))
        self._recv_phase = defaultdict(lambda: defaultdict(int))
        self._read = defaultdict(int)  # worker -> bytes read from storage
        self._input = defaultdict(int)  # "client" / "storage" -> bytes measured
        self._pred_input = defaultdict(int)  # the same, predicted
        self._other = 0

    def add_step(self, batch: int):
        """Count one step of ``batch`` samples in the prediction."""
        self.steps += 1
        if batch not in self._phases:  # one prediction per batch size, not per step
            self._phases[batch] = predict_step(self.engine, self.grid.pr, self.grid.pc, batch,
                                               self.machine, self.word_bytes,
                                               self.grad_clip)
        for p in self._phases[batch]:
            acc = self._pred[(p.layer, p.phase)]
            acc[0] += p.total_bytes
            acc[1] += p.seconds
        if batch not in self._inputs_pred:
            self._inputs_pred[batch] = self._input_bytes(batch)
        client, storage = self._inputs_pred[batch]
        self._pred_input["client"] += client
        if storage:
            self._pred_input["storage"] += storage

    def add_phase(self, phase) -> None:
        """Count one phase outside the steps' own (a refresh of the replicas,
        :mod:`dask_ipar.runtime.replicas`) in the prediction."""
        acc = self._pred[(phase.layer, phase.phase)]
        acc[0] += phase.total_bytes
        acc[1] += phase.seconds

    def _input_bytes(self, batch: int) -> tuple[int, int]:
        """Predicted data bytes of a step: what the client sends, and what the cells read
        from storage (the rows they need, as stored: uncompressed, no chunk rounding)."""
        import numpy as np

        from dask_ipar.layout.placement import STRIPS
        from dask_ipar.runtime.placement import input_copies

        pr = self.grid.pr
        copies = input_copies(self.engine)
        client = storage = 0
        if self.inputs is None:
            client += batch * int(np.prod(self.engine_input_shape())) * self.word_bytes * copies
        else:
            src = self.inputs.data.src
            where = None if self.engine.front is None else self.engine.front.input_placement
            # strips of images stored other than (n, C, H, W) are cut after a whole read
            whole = where == STRIPS and len(src.shape) != 4
            reads = pr if whole else copies
            storage += batch * int(np.prod(src.shape[1:])) * src.dtype.itemsize * reads
        if self.labels is None:
            client += batch * 8 * pr  # int64 labels of its column to every cell
        else:
            storage += batch * self.labels.data.src.dtype.itemsize * pr
        return client, storage

    def engine_input_shape(self) -> tuple:
        front = self.engine.front
        if front is not None:
            return tuple(front.layouts[0].in_shape)
        return (self.engine.layouts[0].n_in,)

    def drain(self, record: bool = True):
        """Empty the workers' transfer logs, attributing every key to its layer and phase.

        Only workers the scheduler still lists are asked (a worker that died would make
        the call wait for a connection timeout; its log is lost with it)."""
        from dask_ipar.runtime.workers import scheduler_workers

        from dask_ipar.runtime.placement import take_sent_bytes

        alive = scheduler_workers(self.client)
        logs = self.client.run(_drain_logs, workers=[w for w in self.workers if w in alive])
        sent = take_sent_bytes(self.engine.uid)
        if not record:  # the run's own reads stay counted (validation reads have own tags)
            return
        read = self._drain_reads([w for w in self.workers if w in alive])
        self._input["client"] += sent
        for w, nbytes in read.items():
            self._input["storage"] += nbytes
            self._read[w] += nbytes
        for sums in logs.values():
            for (sender, receiver, lp), (nbytes, secs) in sums.items():
                self._recv[receiver] += nbytes
                self._sent[sender] += nbytes
                if lp is None:
                    self._other += nbytes
                    continue
                self._bytes[lp] += nbytes
                self._secs[(*lp, receiver)] += secs
                self._sent_phase[lp][sender] += nbytes
                self._recv_phase[lp][receiver] += nbytes

    def _drain_reads(self, workers) -> dict:
        """Bytes each worker read from storage for this run's data since the last drain."""
        tags = [d.tag for d in (self.inputs, self.labels) if d is not None]
        if not tags:
            return {}
        from dask_ipar.io.lazy import drain_read_bytes

        out = {}
        for tag in tags:
            for w, got in self.client.run(drain_read_bytes, tag, workers=workers).items():
                out[w] = out.get(w, 0) + sum(got.values())
        return out

    def report(self) -> CommReport:
        """Per-step means of predicted and measured bytes and seconds, per layer and phase.

        Measured seconds: the busiest receiver's transfer time in that phase per step.
        """
        n = max(self.steps, 1)
        busiest = defaultdict(float)
        for (layer, phase, _), s in self._secs.items():
            busiest[(layer, phase)] = max(busiest[(layer, phase)], s)
        rows = [
            CommRow(layer, phase, pb / n, self._bytes.get((layer, phase), 0) / n,
                    ps / n, busiest.get((layer, phase), 0.0) / n)
            for (layer, phase), (pb, ps) in self._pred.items()
        ]
        known = set(self._pred)
        for lp, b in self._bytes.items():  # measured phases the model does not know
            if lp not in known:
                rows.append(CommRow(*lp, 0.0, b / n, 0.0, busiest.get(lp, 0.0) / n))
        return CommReport(
            steps=self.steps,
            rows=rows,
            sent_bytes=dict(self._sent),
            received_bytes=dict(self._recv),
            sent_by_phase={k: dict(v) for k, v in self._sent_phase.items()},
            received_by_phase={k: dict(v) for k, v in self._recv_phase.items()},
            unattributed_bytes=self._other,
            storage_read_bytes=dict(self._read),
            input_rows=[CommRow("input", k, self._pred_input[k] / n, self._input[k] / n, 0.0,
                                0.0) for k in ("client", "storage")
                        if k == "client" or k in self._pred_input],
        )
