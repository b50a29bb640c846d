"""CNNs on every grid equal the single-process NumPy reference (forward, loss, every
gradient, SGD steps), and move exactly the bytes the cost model predicts: halo
exchanges, conv weight all-reduces, the flatten redistribution and the dense phases."""

from __future__ import annotations

import numpy as np
import pytest

from dask_ipar import AvgPool2d, Conv2d, Dense, Flatten, IparError, MaxPool2d, Sequential
from dask_ipar.layout.grid import factorizations, parse_grid
from dask_ipar.testing import check_cnn

GRIDS = [g for p in (1, 2, 3, 4, 6, 8) for g in factorizations(p)]
# every grid up to 4 processes, the 2-D ones of 6 and 8 (many processes on 2 cores are the
# slow ones; 1-D strips and batches are covered up to 4)
REFERENCE_GRIDS = [g for g in GRIDS if g.size <= 4 or (g.pr, g.pc) in ((2, 3), (3, 2), (2, 4))]


@pytest.mark.parametrize("grid", REFERENCE_GRIDS, ids=str)
def test_cnn_matches_reference(client, grid):
    errors = check_cnn(client, grid)  # B = 9, float64, 2 SGD steps, heights 35/17/9/10
    rows = {(r.layer, r.phase): r for r in errors["comm"].rows}
    # the convs' windows always cross strip boundaries (pooling windows may not)
    for lp in [("conv0", "halo_fwd"), ("conv2", "halo_fwd"), ("conv2", "halo_bwd")]:
        assert (rows[lp].measured_bytes > 0) == (grid.pr > 1)
    assert ("conv0", "halo_bwd") not in rows  # the first layer returns no ghost rows
    assert (rows[("flatten4", "redistribute")].measured_bytes > 0) == (grid.pr > 1)
    assert (rows[("conv2", "dw_reduce")].measured_bytes > 0) == (grid.size > 1)


def test_cnn_finite_difference(client):
    errors = check_cnn(client, "2x2", fd_eps=1e-6, steps=1)
    assert errors["finite_difference"] < 1e-6


@pytest.mark.parametrize("grid", ["4x1", "2x3"])
def test_cnn_strides_groups_and_thin_strips(client, grid):
    """An AlexNet-like 11x11 stride-4 conv on an odd height, grouped 5x5 convs whose
    2-row halo is wider than 1- and 2-row strips, and overlapping 3x3 stride-2 pooling."""
    layers = [Conv2d(6, 11, stride=4, padding=2, activation="relu"),
              MaxPool2d(3, stride=2),
              Conv2d(4, 5, padding=2, groups=2, activation="relu"),
              Conv2d(4, 5, padding=2, groups=2, bias=False),
              Flatten(), Dense(5)]
    # heights: 47 -> 11 -> 5 -> 5 -> 5; on 4x1 the strips are 1-2 rows, thinner than the halo
    check_cnn(client, grid, layers=layers, input_shape=(3, 47, 27), batch=6, steps=2)


def test_more_processes_than_samples(client):
    """P = 8 > B = 4: a 4x2 grid splits each image over 4 strips and the batch in 2."""
    layers = [Conv2d(4, 3, activation="relu"), MaxPool2d(2), Conv2d(4, 3, activation="relu"),
              Flatten(), Dense(10)]
    errors = check_cnn(client, "4x2", layers=layers, input_shape=(1, 16, 16), batch=4, steps=4)
    assert errors["comm"].steps == 4


def test_cnn_errors(client):
    conv = Conv2d(4, 3)
    with pytest.raises(IparError, match="must be Flatten"):
        Sequential([conv, Dense(3)], input_shape=(1, 8, 8))
    with pytest.raises(IparError, match="input_shape"):
        Sequential([conv, Flatten(), Dense(3)])
    with pytest.raises(IparError, match="come before Flatten"):
        Sequential([conv, Flatten(), Dense(3), MaxPool2d(2), Dense(3)], input_shape=(1, 8, 8))
    with pytest.raises(IparError, match="kernel_size"):
        Conv2d(4, 0)
    with pytest.raises(IparError, match="padding"):
        Conv2d(4, 3, padding="full")
    with pytest.raises(IparError, match="too small"):
        Sequential([Conv2d(4, 5, padding=0), Flatten(), Dense(3)], input_shape=(1, 4, 4))
    model = Sequential([conv, MaxPool2d(2), Flatten(), Dense(3)], input_shape=(1, 6, 6))
    with pytest.raises(IparError, match="fewer than the grid's Pr = 4"):
        model.distribute(client, "4x1")  # pooling leaves 3 rows
    model.distribute(client, "2x1")
    with pytest.raises(IparError, match=r"images have shape \(1, 5, 6\)"):
        model.forward(np.zeros((2, 1, 5, 6)))
    with pytest.raises(IparError, match=r"W has shape \(4, 9\), expected \(4, 1, 3, 3\)"):
        model.set_weights([(np.zeros((4, 9)), np.zeros(4)), (np.zeros((3, 36)), np.zeros(3))])
    # flattened images are accepted
    assert model.forward(np.zeros((2, 36))).shape == (2, 3)
    model.close()


def test_cnn_checkpoint_moves_between_grids(client, tmp_path):
    """Conv weights and momentum saved on 2x2 come back on 4x1 and train on identically."""
    from dask_ipar.io import checkpoint
    from dask_ipar.optim import SGD

    layers = [Conv2d(3, 3, activation="relu"), MaxPool2d(2), Flatten(), Dense(4)]
    rng = np.random.default_rng(3)
    X, y = rng.standard_normal((8, 1, 12, 10)), rng.integers(0, 4, 8)
    opt = SGD(lr=0.1, momentum=0.9)
    a = Sequential(layers, input_shape=(1, 12, 10), dtype="float64").distribute(client, "2x2")
    a.fit(X, y, epochs=2, batch_size=8, shuffle=False, optimizer=opt, measure=False)
    checkpoint.save(a, tmp_path)
    b = Sequential(layers, input_shape=(1, 12, 10), dtype="float64", seed=9)
    b.distribute(client, "4x1")
    checkpoint.load(b, tmp_path)
    for (wa, ba), (wb, bb) in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_array_equal(wa, wb)
        np.testing.assert_array_equal(ba, bb)
    for m in (a, b):  # the momentum came along: one more step agrees
        m.fit(X, y, epochs=1, batch_size=8, shuffle=False, optimizer=opt, measure=False)
    for (wa, _), (wb, _) in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(wa, wb, rtol=1e-12, atol=1e-14)
    a.close()
    b.close()


MIXED = [Conv2d(4, 3, activation="relu"), MaxPool2d(2),
         Conv2d(6, (5, 3), stride=2, padding=(2, 1, 1, 1), activation="tanh", parallel="model"),
         AvgPool2d(2, stride=1, padding=1),
         Conv2d(5, 3, activation="relu", parallel="model"),
         Flatten(), Dense(11, "relu"), Dense(8)]


@pytest.mark.parametrize("grid", ["1x1", "2x1", "1x2", "2x2", "3x2", "4x1"], ids=str)
def test_mixed_domain_and_model_parallel_convs(client, grid):
    """Domain-parallel strips, then convs with their filters over Pr (whole images,
    channel blocks), pooling on channel blocks, then the dense layers: exact, and every
    redistribution, gather and reduce-scatter moves the predicted bytes."""
    errors = check_cnn(client, grid, layers=MIXED, input_shape=(2, 35, 9), batch=7, steps=2)
    grid = parse_grid(grid)
    rows = {(r.layer, r.phase): r for r in errors["comm"].rows}
    gathers = [("conv2", "redistribute"), ("pool3", "fwd_gather"), ("conv2", "dx_reduce"),
               ("conv4", "dx_reduce"), ("flatten5", "redistribute")]
    for lp in gathers:
        assert (rows[lp].measured_bytes > 0) == (grid.pr > 1), lp
    for lp in [("conv2", "dw_reduce"), ("conv4", "w_gather")]:
        assert (rows[lp].measured_bytes > 0) == (grid.pc > 1), lp


def test_model_parallel_first_layer(client):
    """The images go whole to every cell of a column when the first conv splits filters."""
    layers = [Conv2d(6, 3, activation="relu", parallel="model"), MaxPool2d(2), Flatten(),
              Dense(8)]
    check_cnn(client, "3x2", layers=layers, input_shape=(2, 9, 7), batch=7, steps=2)


def test_model_parallel_conv_errors(client):
    with pytest.raises(IparError, match="domain-parallel but follows a model-parallel"):
        Sequential([Conv2d(4, 3, parallel="model"), Conv2d(4, 3), Flatten(), Dense(3)],
                   input_shape=(1, 8, 8))
    with pytest.raises(IparError, match="groups=1"):
        Conv2d(4, 3, groups=2, parallel="model")
    with pytest.raises(IparError, match="parallel must be"):
        Conv2d(4, 3, parallel="data")
    m = Sequential([Conv2d(2, 3, parallel="model"), Flatten(), Dense(4)], input_shape=(1, 8, 8))
    with pytest.raises(IparError, match="2 filters, fewer than the grid's Pr = 4"):
        m.distribute(client, "4x1")


def test_planner_sets_each_conv_layers_scheme():
    """plan_layers: the cost model's per-layer choice becomes each Conv2d's ``parallel``,
    within what the engine runs (domain first, then model; whole filters per grid row)."""
    from dask_ipar.cost import Machine
    from dask_ipar.nn.planning import cost_specs, plan_layers

    layers = [Conv2d(8, 3, activation="relu"), MaxPool2d(2), Conv2d(64, 3, activation="relu"),
              Conv2d(64, 3, activation="relu"), Flatten(), Dense(10)]
    specs = cost_specs(layers, (3, 32, 32))
    assert [s.name for s in specs] == ["conv0", "pool1", "conv2", "conv3", "dense5"]
    assert (specs[2].in_h, specs[2].out_h, specs[4].d_in) == (16, 16, 64 * 16 * 16)
    for machine in (Machine(alpha_s=1e-3, bandwidth_Bps=1e9), Machine(alpha_s=1e-6,
                                                                     bandwidth_Bps=1e7)):
        for procs, batch in ((4, 16), (8, 4)):
            grid, planned, best = plan_layers(layers, (3, 32, 32), procs, batch, machine)
            assert grid.size == procs
            chosen = dict(best.schemes)
            schemes = [lay.parallel for lay in planned if isinstance(lay, Conv2d)]
            assert schemes == [chosen[n] for n in ("conv0", "conv2", "conv3")]
            assert schemes == sorted(schemes)  # "domain" before "model"
            Sequential(planned, input_shape=(3, 32, 32))  # a model the engine accepts
    grid, planned, _ = plan_layers(layers, (3, 32, 32), 4, 16, grid="4x1")
    assert str(grid) == "4x1"
    with pytest.raises(IparError, match="no way to run"):
        plan_layers(layers, (3, 32, 32), 64, 16, grid="64x1")  # 16 rows, 8 filters


ALL_THREE = [Conv2d(4, 3, activation="relu", parallel="batch"), MaxPool2d(2),
             Conv2d(6, (5, 3), stride=2, padding=(2, 1, 1, 1), activation="tanh"),
             AvgPool2d(2, stride=1, padding=1),
             Conv2d(5, 3, activation="relu", parallel="model"),
             Flatten(), Dense(11, "relu"), Dense(8)]


@pytest.mark.parametrize("grid", ["1x1", "2x1", "2x2", "3x2"], ids=str)
def test_batch_domain_and_model_parallel_convs(client, grid):
    """Whole images of each cell's samples (batch), an all-to-all to strips (domain), a
    gather to whole images with filters over Pr (model), then the dense layers."""
    errors = check_cnn(client, grid, layers=ALL_THREE, input_shape=(2, 35, 9), batch=9,
                       steps=2)
    grid = parse_grid(grid)
    rows = {(r.layer, r.phase): r for r in errors["comm"].rows}
    for lp in [("conv2", "redistribute"), ("conv2", "dx_reduce"), ("conv4", "redistribute")]:
        assert (rows[lp].measured_bytes > 0) == (grid.pr > 1), lp
    assert (rows[("conv0", "dw_reduce")].measured_bytes > 0) == (grid.size > 1)


@pytest.mark.parametrize("grid,layers", [
    ("2x2", [Conv2d(4, 3, activation="relu", parallel="batch"), MaxPool2d(2), Flatten(),
             Dense(8)]),
    ("3x1", [Conv2d(4, 3, activation="relu", parallel="batch"),
             Conv2d(5, 3, parallel="model"), Flatten(), Dense(8)]),
], ids=["batch-flatten", "batch-model"])
def test_batch_parallel_conv_into_the_next_layouts(client, grid, layers):
    check_cnn(client, grid, layers=layers, input_shape=(2, 10, 7), batch=7, steps=2)


def test_batch_parallel_conv_errors(client):
    with pytest.raises(IparError, match="batch-parallel but follows a domain-parallel"):
        Sequential([Conv2d(4, 3), Conv2d(4, 3, parallel="batch"), Flatten(), Dense(3)],
                   input_shape=(1, 8, 8))
    m = Sequential([Conv2d(4, 3, parallel="batch"), Flatten(), Dense(3)], input_shape=(1, 8, 8))
    m.distribute(client, "2x2")
    with pytest.raises(IparError, match="smaller than the 4 cells"):
        m.fit(np.zeros((3, 1, 8, 8)), np.zeros(3, int), batch_size=3)
    m.close()


# ------------------------------------------------- one cost path: planner == meter
def _engine_on_fake_workers(layers, input_shape, pr, pc):
    """The engine of a CNN bound to fake worker addresses (graphs only, no cluster)."""
    from dask_ipar.nn.dense import Engine
    from dask_ipar.nn.dense_layout import LayerLayout
    from dask_ipar.nn.front import Front, front_layouts
    from dask_ipar.layout.grid import Grid, GridBinding

    m = Sequential(layers, input_shape=input_shape)
    grid = Grid(pr, pc)
    binding = GridBinding(grid, tuple(f"tcp://10.0.0.{k}:1" for k in range(grid.size)))
    first = len(m.layers) - len(m.dense_layers)
    layouts = [LayerLayout.build(k, m.sizes[k], lay, pr, pc)
               for k, lay in enumerate(m.dense_layers, start=first)]
    front = Front(binding, front_layouts(m.layers[:m._n_front], input_shape, pr, pc),
                  f"flatten{m._n_front}", "t")
    return Engine(binding, layouts, "t", front=front)


PLANNED = {
    "awkward": None,  # dask_ipar.testing.awkward_cnn: stride 2, asymmetric padding, pools
    "strides": ([Conv2d(6, 11, stride=4, padding=2, activation="relu"), MaxPool2d(3, stride=2),
                 Conv2d(4, 5, padding=2, groups=2, activation="relu"),
                 Conv2d(4, 5, padding=2, groups=2, bias=False), Flatten(), Dense(5)],
                (3, 47, 27)),
    "issue-25": ([Conv2d(8, 3, activation="relu"), Conv2d(32, 3, activation="relu"), Flatten(),
                  Dense(10)], (3, 16, 16)),
}


@pytest.mark.parametrize("net", list(PLANNED))
def test_planner_prices_exactly_what_the_meter_predicts(net):
    """Domain-parallel CNNs on every grid the engine runs: the planner's bytes per layer and
    phase equal the comm table's prediction (which test_cnn_matches_reference checks
    against the measured bytes), under the same names: the flatten redistribution is
    ``flatten<k>``'s ``redistribute`` in both."""
    from dask_ipar import cost
    from dask_ipar.cost import LOOPBACK_MACHINE
    from dask_ipar.runtime.meter import predict_step
    from dask_ipar.nn.planning import ENGINE_SCHEMES, cost_specs
    from dask_ipar.testing import awkward_cnn

    layers, shape = PLANNED[net] or awkward_cnn()
    batch = 9
    checked = 0
    for grid in GRIDS:
        try:
            eng = _engine_on_fake_workers(layers, shape, grid.pr, grid.pc)
        except (IparError, ValueError):
            continue  # a strip without rows: the engine refuses this grid
        meter = {(p.layer, p.phase): p.total_bytes
                 for p in predict_step(eng, grid.pr, grid.pc, batch, LOOPBACK_MACHINE, 8)}
        plan = cost.evaluate_grid(cost_specs(layers, shape), grid.pr, grid.pc, batch,
                                  cost.Machine(alpha_s=1e-3, bandwidth_Bps=1e9, word_bytes=8),
                                  conv="domain", schemes=ENGINE_SCHEMES)
        assert plan.feasible, (grid, plan.reason)
        planned = {}
        for p in plan.phases:
            planned[(p.layer, p.phase)] = planned.get((p.layer, p.phase), 0) + p.total_bytes
        keys = {k for k, v in {**meter, **planned}.items() if v}
        assert {k: planned.get(k, 0) for k in keys} == {k: meter.get(k, 0) for k in keys}, grid
        checked += 1
    assert checked >= 8


def test_issue_25_cnn_moves_what_the_planner_prices(client):
    """The 3->8->32-channel CNN of the architecture issue on 2x1, batch 8: the bytes dask
    moves per layer and phase equal the planner's price and the comm table's prediction
    (the issue quotes 564,544 B per step in float32; float64 words here: twice that)."""
    from dask_ipar import cost
    from dask_ipar.nn.planning import cost_specs

    layers, shape = PLANNED["issue-25"]
    errors = check_cnn(client, "2x1", layers=layers, input_shape=shape, batch=8, steps=2)
    measured = {(r.layer, r.phase): r.measured_bytes for r in errors["comm"].rows
                if r.measured_bytes}
    plan = cost.price_assignment(cost_specs(layers, shape), {}, 2, 1, 8,
                                 cost.Machine(alpha_s=1e-3, bandwidth_Bps=1e9, word_bytes=8))
    planned = {}
    for p in plan.phases:
        planned[(p.layer, p.phase)] = planned.get((p.layer, p.phase), 0) + p.total_bytes
    assert {k: v for k, v in planned.items() if v} == measured
    assert sum(measured.values()) == 2 * 564_544
    assert measured[("conv1", "halo_bwd")] == 2 * 8_192
    assert ("conv0", "halo_bwd") not in measured  # the first layer sends no ghost rows back


@pytest.mark.parametrize("net,grid", [("strides", "2x2"), ("mlp-deep", "2x2"),
                                      ("issue-25", "2x2")])
def test_networks_built_only_as_graphs_elsewhere_move_what_the_planner_prices(client, net,
                                                                              grid):
    """The networks tests/test_routes.py builds as graphs only: on a cluster, the bytes dask
    moves per layer and phase equal the planner's price of the network's schemes."""
    from dask_ipar import cost
    from dask_ipar.layout.grid import parse_grid
    from dask_ipar.nn.planning import cost_specs
    from dask_ipar.testing import compare_cnn, compare_mlp
    from test_routes import NETWORKS

    layers, shape = NETWORKS[net]
    g = parse_grid(grid)
    if isinstance(shape, int):
        errors = compare_mlp(client, grid, sizes=(shape,), layers=layers, batch=9, steps=2,
                             fd_eps=None)
    else:
        errors = compare_cnn(client, grid, layers=layers, input_shape=shape, batch=9, steps=2)
    measured = {(r.layer, r.phase): r.measured_bytes for r in errors["comm"].rows
                if r.measured_bytes}
    schemes = {f"conv{k}": lay.parallel for k, lay in enumerate(layers)
               if isinstance(lay, Conv2d)}
    plan = cost.price_assignment(cost_specs(layers, shape), schemes, g.pr, g.pc, 9,
                                 cost.Machine(alpha_s=1e-3, bandwidth_Bps=1e9, word_bytes=8))
    assert plan.feasible, plan.reason
    planned = {}
    for p in plan.phases:
        planned[(p.layer, p.phase)] = planned.get((p.layer, p.phase), 0) + p.total_bytes
    assert {k: v for k, v in planned.items() if v} == measured
