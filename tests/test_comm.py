"""Measured communication against the cost model: balance, log draining, the report."""

from __future__ import annotations

import numpy as np
import pytest

from dask_ipar import Dense, Sequential
from dask_ipar.layout.grid import parse_grid

# Grids with a row all-reduce, P in {2, 4, 6, 8}: pure batch, square, and tall and wide mixes.
BALANCE_GRIDS = [parse_grid(g) for g in ("1x2", "2x2", "3x2", "2x4", "1x8")]


def _fit(client, grid, sizes=(71, 48, 36, 12), batch=48, steps=2, executor=None):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((batch * steps, sizes[0]))
    y = rng.integers(0, sizes[-1], batch * steps)
    layers = [Dense(w, "relu") for w in sizes[1:-1]] + [Dense(sizes[-1])]
    model = Sequential(layers, input_dim=sizes[0], dtype="float32").distribute(client, grid)
    model.executor = executor or model.executor
    hist = model.fit(X, y, epochs=1, batch_size=batch)
    return model, hist.comm


@pytest.mark.parametrize("executor", ["programs", "graph"])
@pytest.mark.parametrize("grid", BALANCE_GRIDS, ids=str)
def test_dw_traffic_is_balanced_like_a_ring_allreduce(client, grid, executor):
    """No home worker: in each half of a layer's dW all-reduce (reduce-scatter, weight
    all-gather) each cell moves (Pc-1)/Pc |W|/Pr words per step, within 10%.

    Programs: the busiest sender of both halves together sends within 10% of twice that
    (each block leaves from its owner). Task graph: the dW pieces leave from the cells that
    computed them, so the reduce-scatter's busiest sender is checked; in the all-gather a
    worker fetches a weight slice from any worker already holding a copy (dask's choice,
    timing-dependent: distributed's ``_select_workers_for_gather``), so there the busiest
    *receiver* is checked, and no sender may send more than half again its share.

    Widths divide every Pr used here; the (n + 1) weight columns split unevenly over
    Pc, which the 10% absorbs."""
    model, comm = _fit(client, grid, executor=executor)

    def per_worker(by_phase, layer, phases):
        out = {}
        for phase in phases:
            for w, b in by_phase.get((layer, phase), {}).items():
                out[w] = out.get(w, 0) + b / comm.steps
        return out

    for lay in model.engine.layouts:
        half = (grid.pc - 1) / grid.pc * lay.n_out * lay.n_cols / grid.pr * 4
        both = per_worker(comm.sent_by_phase, lay.name, ("dw_reduce", "w_gather"))
        assert len(both) == grid.size, "every cell takes part in the all-reduce"
        if executor == "programs":
            checks = [("sent, both halves", both, 2 * half)]
        else:
            checks = [
                ("sent, reduce-scatter",
                 per_worker(comm.sent_by_phase, lay.name, ("dw_reduce",)), half),
                ("received, all-gather",
                 per_worker(comm.received_by_phase, lay.name, ("w_gather",)), half),
            ]
            gather_sent = per_worker(comm.sent_by_phase, lay.name, ("w_gather",))
            assert max(gather_sent.values()) <= 1.5 * half, (lay.name, gather_sent, half)
        for what, moved, ideal in checks:
            assert len(moved) == grid.size, (lay.name, what, moved)
            busiest = max(moved.values())
            assert abs(busiest / ideal - 1) <= 0.10, (lay.name, what, busiest, ideal)
    model.close()


def test_nothing_lost_when_a_step_overflows_the_log_cap():
    """Workers whose transfer logs keep only 5 entries still report every byte (dask's
    logs: the task-by-task executor)."""
    import dask
    from distributed import Client, LocalCluster

    with dask.config.set({"distributed.admin.low-level-log-length": 5}):
        with LocalCluster(n_workers=4, threads_per_worker=1, processes=True,
                          dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as c:
            caps = c.run(lambda dask_worker: dask_worker.transfer_incoming_log.maxlen)
            assert set(caps.values()) == {5}
            model, comm = _fit(c, "2x2", executor="graph")
            for r in comm.rows:
                assert abs(r.ratio - 1) <= 0.02, r
            # a 2x2 step makes each worker receive far more than 5 transfers
            assert sum(r.measured_bytes for r in comm.rows) > 0
            model.close()


def test_report_table_and_per_worker_totals(client):
    model, comm = _fit(client, "2x2")
    text = comm.table()
    assert "dense0" in text and "fwd_gather" in text and "w_gather" in text
    assert sum(comm.sent_bytes.values()) == sum(comm.received_bytes.values())
    assert comm.unattributed_bytes == 0
    assert set(comm.sent_bytes) == set(model.binding.workers)
    model.close()


def test_transfer_logs_are_summed_per_sender_receiver_and_phase():
    """What a worker sends back for its log: bytes and seconds per sender, receiver and
    layer phase, an entry's seconds shared among its keys by their bytes."""
    from dask_ipar.runtime.meter import summarize_transfers

    k1 = ("dense1.dwp-0a1b2c3d-s7", 0, 1, 0)  # dense1 dw_reduce
    k2 = ("dense1.act-0a1b2c3d-s7", 0, 1)  # dense1 fwd_gather
    other = ("something-else", 0)
    got = summarize_transfers([
        ("a", "b", 1.0, [(k1, 300), (k2, 100)]),
        ("a", "b", 0.5, [(k1, 50)]),
        ("c", "b", 2.0, [(other, 10)]),
        ("a", "b", 0.25, []),  # an entry of no keys adds nothing
    ])
    assert got == {("a", "b", ("dense1", "dw_reduce")): [350, 0.75 + 0.5],
                   ("a", "b", ("dense1", "fwd_gather")): [100, 0.25],
                   ("c", "b", None): [10, 2.0]}
