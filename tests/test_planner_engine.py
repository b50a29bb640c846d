"""One cost path, planner side: for every network of the suite (tests/test_routes.py) on
every grid up to P = 8, the planner, given the network's own per-layer schemes
(:func:`dask_ipar.cost.price_assignment`), prices exactly the bytes per layer and phase
that the run's comm table predicts (:func:`dask_ipar.runtime.meter.predict_step`), which
are the words the step graph's collectives route (``graph.routed_words()``, 8-byte
words); and it refuses exactly the grids the engine refuses. The planner's search
(``evaluate_grid(..., schemes=ENGINE_SCHEMES)``) only ever picks assignments the
engine runs, priced the same way. Graphs only (fake addresses, no cluster).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict

import pytest

from dask_ipar import Sequential, cost
from dask_ipar.errors import IparError
from dask_ipar.layout.partition import grid_shapes
from dask_ipar.nn.dense_layout import check_dense_grid
from dask_ipar.nn.layers import Conv2d
from dask_ipar.nn.planning import ENGINE_SCHEMES, cost_specs
from dask_ipar.runtime.meter import predict_step
from dask_ipar.runtime.placement import check_batch
from dask_ipar.testing import step_graph
from test_routes import NETWORKS

pytestmark = pytest.mark.fast  # no cluster: graphs, kernels and formulas only

MACHINE = cost.Machine(alpha_s=1e-3, bandwidth_Bps=1e9, word_bytes=8)
GRIDS = [g for p in range(1, 9) for g in grid_shapes(p)]


def _model(layers, shape):
    if isinstance(shape, int):
        return Sequential(layers, input_dim=shape)
    return Sequential(layers, input_shape=shape)


def _engine(model, pr, pc, batch):
    """``(engine, graph)`` of one step on ``pr x pc``, or the engine's refusal (a string):
    the checks of ``distribute`` and ``fit`` beside those of building the graph."""
    try:
        engine, graph = step_graph(model, f"{pr}x{pc}", batch)
        first = len(model.layers) - len(model.dense_layers)
        check_dense_grid(model.dense_layers, first, engine.grid, model.sizes)
        check_batch(engine, engine.grid, batch, batch)
    except (IparError, ValueError) as exc:
        return str(exc)
    return engine, graph


def _schemes(layers):
    return {f"conv{k}": lay.parallel for k, lay in enumerate(layers) if isinstance(lay, Conv2d)}


def _by_phase(phases):
    out = defaultdict(int)
    for p in phases:
        out[(p.layer, p.phase)] += p.total_bytes
    return out


def _same(*tables):
    keys = {k for t in tables for k, v in t.items() if v}
    return [{k: t.get(k, 0) for k in keys} for t in tables]


@pytest.mark.parametrize("batch", [4, 9, 16])
@pytest.mark.parametrize("net", list(NETWORKS))
def test_planner_prices_the_networks_own_schemes_as_the_engine_runs_them(net, batch):
    layers, shape = NETWORKS[net]
    checked = refused = 0
    for pr, pc in GRIDS:
        model = _model(layers, shape)
        built = _engine(model, pr, pc, batch)
        gp = cost.price_assignment(cost_specs(model.layers, shape), _schemes(model.layers), pr,
                                   pc, batch, MACHINE)
        if isinstance(built, str):
            assert not gp.feasible, (net, pr, pc, "the engine refuses:", built)
            refused += 1
            continue
        assert gp.feasible, (net, pr, pc, gp.reason)
        engine, graph = built
        planned = _by_phase(gp.phases)
        meter = _by_phase(predict_step(engine, pr, pc, batch, MACHINE, 8))
        routed = {k: 8 * w for k, w in graph.routed_words().items()}
        a, b, c = _same(planned, meter, routed)
        assert a == b == c, (net, pr, pc)
        checked += 1
    assert checked >= 6 and checked + refused == len(GRIDS), (checked, refused)


def _assignments(layers):
    """Every assignment of the engine's schemes to the conv layers, in the engine's order,
    with the layers it gives (None where a layer refuses its scheme: a grouped conv
    cannot split its filters)."""
    convs = [k for k, lay in enumerate(layers) if isinstance(lay, Conv2d)]
    for combo in itertools.combinations_with_replacement(ENGINE_SCHEMES, len(convs)):
        out = list(layers)
        try:
            for k, s in zip(convs, combo):
                out[k] = dataclasses.replace(layers[k], parallel=s)
        except IparError:
            out = None
        yield {f"conv{k}": s for k, s in zip(convs, combo)}, out


CNNS = [n for n, (_, shape) in NETWORKS.items() if not isinstance(shape, int)]


@pytest.mark.parametrize("net", CNNS)
def test_planner_search_picks_only_what_the_engine_runs(net):
    """Every engine-ordered assignment of schemes to the conv layers: priced feasible
    exactly where the engine runs it, and there priced as the comm table predicts and the
    graph routes; the search's best is one of them, priced identically (batch 9)."""
    layers, shape = NETWORKS[net]
    batch = 9
    specs = cost_specs(_model(layers, shape).layers, shape)
    checked = 0
    for pr, pc in GRIDS:
        feasible = {}
        for schemes, variant in _assignments(layers):
            gp = cost.price_assignment(specs, schemes, pr, pc, batch, MACHINE)
            built = "a layer refuses its scheme" if variant is None else \
                _engine(_model(variant, shape), pr, pc, batch)
            assert gp.feasible == (not isinstance(built, str)), (net, pr, pc, schemes, built)
            if not gp.feasible:
                continue
            engine, graph = built
            meter = _by_phase(predict_step(engine, pr, pc, batch, MACHINE, 8))
            routed = {k: 8 * w for k, w in graph.routed_words().items()}
            a, b, c = _same(_by_phase(gp.phases), meter, routed)
            assert a == b == c, (net, pr, pc, schemes)
            feasible[tuple(sorted(schemes.items()))] = gp
            checked += 1
        best = cost.evaluate_grid(specs, pr, pc, batch, MACHINE, conv="auto",
                                  schemes=ENGINE_SCHEMES)
        assert best.feasible == bool(feasible), (net, pr, pc, best.reason)
        if best.feasible:
            same = feasible[tuple(sorted((n, s) for n, s in best.schemes if n.startswith("conv")))]
            assert best.phases == same.phases, (net, pr, pc)
            assert best.total_s == min(g.total_s for g in feasible.values())
    assert checked >= 8


def test_price_assignment_names_and_errors():
    layers, shape = NETWORKS["all-three"]
    model = _model(layers, shape)
    specs = cost_specs(model.layers, shape)
    assert specs[-2].name == "dense6" and specs[-2].flatten == "flatten5"
    gp = cost.price_assignment(specs, _schemes(model.layers), 2, 2, 9, MACHINE)
    assert gp.feasible
    assert dict(gp.schemes) == {**_schemes(model.layers), "dense6": "model", "dense7": "model"}
    names = {(p.layer, p.phase) for p in gp.phases if p.total_bytes}
    assert ("flatten5", "redistribute") in names and ("dense6", "redistribute") not in names
    assert {("conv2", "redistribute"), ("conv2", "dx_reduce"), ("conv4", "redistribute"),
            ("conv4", "dx_reduce"), ("conv4", "w_gather")} <= names
    # conv layers the mapping leaves out are domain-parallel (the engine's default)
    everything = cost.price_assignment(specs, {}, 2, 2, 9, MACHINE)
    assert {s for n, s in everything.schemes if n.startswith("conv")} == {"domain"}
    # the order batch -> domain -> model, filters per grid row, samples per cell
    assert not cost.price_assignment(specs, {"conv0": "model", "conv2": "domain"}, 1, 1, 9,
                                     MACHINE).feasible
    assert "filters" in cost.price_assignment(specs, _schemes(model.layers), 6, 1, 9,
                                              MACHINE).reason
    assert "batch" in cost.price_assignment(specs, _schemes(model.layers), 2, 4, 6, MACHINE).reason
    with pytest.raises(ValueError, match="name no conv layer"):
        cost.price_assignment(specs, {"pool1": "batch"}, 1, 1, 9, MACHINE)
    with pytest.raises(ValueError, match="expected schemes"):
        cost.price_assignment(specs, {"conv0": "data"}, 1, 1, 9, MACHINE)


def test_mlp_phases_are_the_dense_formula():
    """An MLP: the engine mode's phases are :func:`dense_layer_phases` (engine convention)."""
    layers, width = NETWORKS["mlp"]
    specs = cost_specs(layers, width)
    gp = cost.price_assignment(specs, {}, 2, 3, 16, MACHINE)
    want = [p for k, fc in enumerate(specs)
            for p in cost.dense_layer_phases(fc, 2, 3, 16, MACHINE, first_layer=k == 0,
                                             convention="engine")]
    assert list(gp.phases) == want


@pytest.mark.parametrize("split", [False, True], ids=["one-task", "own-rows-first"])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_an_update_in_place_follows_every_reader_of_its_weights(monkeypatch, split, opt):
    """In two consecutive steps' graph (3x2, no cluster), every task on a cell that reads
    the cell's weight slice of step 0 is an ancestor of the step-1 update that rewrites
    that slice in place: with the forward and the dX sum as one task each, and with the
    own rows first (forced on this small MLP: ``act_own``, ``dxown``)."""
    from dask_ipar import SGD, Adam, Dense, Sequential
    from dask_ipar.layout.grid import GridBinding, parse_grid
    from dask_ipar.nn import dense_layout
    from dask_ipar.runtime.stepmodel import step_tasks

    if split:
        monkeypatch.setattr(dense_layout, "OWN_FIRST_MACS", 0)
    m = Sequential([Dense(13, "relu"), Dense(11, "tanh"), Dense(5)], input_dim=9,
                   dtype="float64")
    eng = m._make_engine(GridBinding.placeholder(parse_grid("3x2")))
    rule = SGD(0.1, momentum=0.9) if opt == "sgd" else Adam(0.01)
    tasks, _ = step_tasks(eng, ["w0", "w1", "w2"], 12, (9,), "float64", rule, steps=2)
    by_key = {t.key: t for t in tasks}
    names = {str(t.key[0]) for t in tasks}
    assert any(".act_own-" in n for n in names) == split
    assert any(".dxown-" in n for n in names) == split

    def ancestors(key, seen=None):
        seen = set() if seen is None else seen
        for d in by_key[key].deps if key in by_key else ():
            if d not in seen:
                seen.add(d)
                ancestors(d, seen)
        return seen

    checked = 0
    for t in tasks:
        name = str(t.key[0])
        if not (name.startswith("dense") and ".w-" in name and name.endswith("-s1")):
            continue
        old = (name[:-1] + "0", *t.key[1:])  # the slice step 1's update rewrites
        if old not in t.deps:
            continue
        up = ancestors(t.key)
        readers = [r.key for r in tasks if old in r.deps and r.key != t.key
                   and r.worker == t.worker]
        assert readers, t.key
        missing = [r for r in readers if r not in up]
        assert not missing, (t.key, missing)
        checked += 1
    assert checked == 3 * 6  # every layer's slice on every cell
