"""One cost path: the words every collective of a step graph routes equal the byte meter's
prediction (the cost model) per layer and phase, for every network of the suite on every
grid up to P = 8. Graphs only (fake addresses, no cluster): the fast tier. The meter's
prediction equals what dask moves (the bytes checks of the exactness suites) and the
planner's price (tests/test_cnn.py::test_planner_prices_exactly_what_the_meter_predicts).
"""

from __future__ import annotations

import pytest

from dask_ipar import Dense, Sequential
from dask_ipar.errors import IparError
from dask_ipar.cost.machine import PAPER_MACHINE
from dask_ipar.layout.partition import grid_shapes
from dask_ipar.nn.layers import Conv2d, Flatten, MaxPool2d
from dask_ipar.runtime.meter import predict_step
from dask_ipar.testing import awkward_cnn, step_graph
from test_cnn import ALL_THREE, MIXED, PLANNED

pytestmark = pytest.mark.fast  # no cluster: graphs, kernels and formulas only

NETWORKS = {
    "mlp": ([Dense(29, "relu"), Dense(13, "tanh"), Dense(10)], 37),
    "mlp-deep": ([Dense(9, "relu")] * 4 + [Dense(5)], 11),
    "awkward-cnn": awkward_cnn(),
    "mixed": (MIXED, (2, 35, 9)),
    "all-three": (ALL_THREE, (2, 35, 9)),
    "batch-flatten": ([Conv2d(4, 3, activation="relu", parallel="batch"), MaxPool2d(2), Flatten(),
                       Dense(8)], (2, 10, 7)),
    "batch-model": ([Conv2d(4, 3, activation="relu", parallel="batch"),
                     Conv2d(5, 3, parallel="model"), Flatten(), Dense(8)], (2, 10, 7)),
    "model-first": ([Conv2d(6, 3, activation="relu", parallel="model"), MaxPool2d(2), Flatten(),
                     Dense(8)], (2, 9, 7)),
    **{k: v for k, v in PLANNED.items() if v is not None},
}


@pytest.mark.parametrize("batch", [9, 16])
@pytest.mark.parametrize("net", list(NETWORKS))
def test_graph_routes_what_the_meter_predicts(net, batch):
    layers, shape = NETWORKS[net]
    checked = 0
    for p in range(1, 9):
        for pr, pc in grid_shapes(p):
            model = Sequential(layers, input_shape=shape) if not isinstance(shape, int) else \
                Sequential(layers, input_dim=shape)
            try:
                engine, g = step_graph(model, f"{pr}x{pc}", batch)
            except (IparError, ValueError):
                continue  # a grid this network cannot run on (the engine says why)
            routed = {k: 8 * w for k, w in g.routed_words().items() if w}
            predicted = {(ph.layer, ph.phase): ph.total_bytes
                         for ph in predict_step(engine, pr, pc, batch, PAPER_MACHINE, 8)
                         if ph.total_bytes}
            assert routed == predicted, (net, pr, pc)
            checked += 1
    assert checked >= 6, checked
