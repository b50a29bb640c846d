"""A thin product's cost beyond its flops: the edge of :func:`dask_ipar.kernels.cost_shapes.gemm`,
the machine's ``gemm_edge_flops`` (measured by ``dask-ipar calibrate``,
:func:`dask_ipar.runtime.calibrate.edge_flops`) and the step model's price of it
(:func:`dask_ipar.runtime.stepmodel.priced`)."""

from __future__ import annotations

import pytest

from dask_ipar.cost import Machine, SimTask
from dask_ipar.kernels.cost_shapes import GEMM_REF_N, gemm
from dask_ipar.runtime.calibrate import THIN, edge_flops
from dask_ipar.runtime.stepmodel import priced

pytestmark = pytest.mark.fast


def test_edge_counts_a_products_elements_beyond_a_square_ones():
    n = GEMM_REF_N
    assert gemm(n, n, n) == (2.0 * n ** 3, 0.0)
    for m, k, nn in [(4096, 4096, 128), (512, 4096, 1024), (7, 3, 5)]:
        flops, edge = gemm(m, k, nn)
        assert flops == 2.0 * m * k * nn
        # the operands' and the result's elements, less a square product's per flop
        assert edge == pytest.approx(m * k + k * nn + m * nn - flops * 3 / (2 * n))
        assert gemm(nn, m, k) == pytest.approx((flops, edge))  # symmetric in the three
    # the same flops, thinner: more edge; larger than the square: less than none
    assert gemm(4096, 4096, 64)[1] > gemm(2048, 2048, 256)[1] > 0 > gemm(2048, 2048, 2048)[1]
    assert gemm(0, 5, 5) == (0.0, 0.0)


def test_edge_flops_recovers_the_figure_that_timed_the_products():
    """Rates made by the model's own formula at a known ``e`` give it back, from a square
    product of the model's side or another; a thin product as fast as the square gives 0."""
    peak = 2e11  # the square 1024 product's rate
    for e in (0.0, 40.0, 95.0):
        for n in (GEMM_REF_N, 512):
            def rate(m, k, nn):
                flops, edge = gemm(m, k, nn)
                return flops * peak / (flops + e * edge)
            got = edge_flops(rate(n, n, n), n, rate(*THIN), THIN)
            assert got == pytest.approx(e, abs=1e-9)
    assert edge_flops(1e11, GEMM_REF_N, 1.2e11, THIN) == 0.0
    assert edge_flops(1e11, GEMM_REF_N, 1e8, THIN) == 600.0  # capped below the bound


def test_the_machine_bounds_the_figure():
    assert Machine(gemm_edge_flops=90.0).gemm_edge_flops == 90.0
    for bad in (-1.0, 700.0, float("nan")):
        with pytest.raises(ValueError, match="gemm_edge_flops"):
            Machine(gemm_edge_flops=bad)


def test_priced_adds_the_edge_as_flops():
    tasks = [SimTask("a", "w", flops=1e9, edge=1e6), SimTask("b", "w", flops=5.0),
             SimTask("c", "w", flops=2e9, edge=-1e5)]
    assert priced(tasks, Machine(flops_per_s=1e11)) == tasks
    got = priced(tasks, Machine(flops_per_s=1e11, gemm_edge_flops=50.0))
    assert [t.flops for t in got] == pytest.approx([1e9 + 5e7, 5.0, 2e9 - 5e6])
    assert all(t.edge == 0.0 for t in got)


def test_one_workers_step_grows_by_its_products_edge_at_the_rate():
    """A one-worker step run as worker programs is the sum of its tasks' work: with
    ``gemm_edge_flops`` the simulated step grows by exactly the step's products' edge times
    the figure over the rate; the edge is that of the products the kernels run. A task
    graph's step grows too."""
    from dask_ipar import SGD, Dense, Sequential
    from dask_ipar.layout.grid import Grid
    from dask_ipar.runtime.stepmodel import simulate_engine, step_tasks
    from dask_ipar.testing import fake_binding

    batch = 64
    model = Sequential([Dense(512, "relu"), Dense(128)], input_dim=256)
    engine = model._make_engine(fake_binding(Grid(1, 1)))
    names = [f"w{k}" for k in range(len(engine.param_layouts))]
    opt = SGD(0.1, momentum=0.9)
    tasks, _ = step_tasks(engine, names, batch, (256,), "float32", opt)
    edge = sum(t.edge for t in tasks)
    # the forward of both layers, the second layer's dX, both dW (the bias column is no
    # product's): each product once
    want = sum(gemm(*s)[1] for s in [(512, 256, batch), (128, 512, batch), (512, 128, batch),
                                     (128, batch, 512), (512, batch, 256)])
    assert edge == pytest.approx(want)
    flops = 1e10
    base = Machine(alpha_s=1e-4, bandwidth_Bps=1e9, flops_per_s=flops, elementwise_Bps=1e10)
    thin = base.replace(gemm_edge_flops=80.0)
    times = {}
    for executor in ("programs", "graph"):
        times[executor] = [simulate_engine(engine, names, batch, (256,), "float32", m, None,
                                           opt, executor).seconds for m in (base, thin)]
    a, b = times["programs"]
    assert b - a == pytest.approx(80.0 * edge / flops, rel=1e-9)
    a, b = times["graph"]
    assert b > a
