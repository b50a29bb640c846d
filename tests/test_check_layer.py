"""``check_layer``: one user layer against the NumPy reference on every grid it fits."""

from __future__ import annotations

import pytest

from dask_ipar.errors import IparError
from dask_ipar.nn.layers import AvgPool2d, Conv2d, Dense, Flatten, MaxPool2d
from dask_ipar.testing import check_layer

GRIDS = ["1x1", "2x1", "1x2", "2x2"]


def _checked(report):
    return {g: e for g, e in report.items() if "skipped" not in e}


def _assert_exact(report, n_weights):
    for grid, errors in _checked(report).items():
        grads = [k for k in errors if k.startswith(("dW", "db"))]
        assert {f"dW{k}" for k in range(n_weights)} <= set(grads), (grid, grads)
        assert max(errors[k] for k in grads) <= 1e-12
        assert errors["finite_difference"] <= 1e-6
        assert all(abs(r.ratio - 1) <= 0.02 for r in errors["comm"].rows)
        moved = sum(r.measured_bytes for r in errors["comm"].rows)
        assert (moved > 0) == (grid != "1x1")


def test_dense_layer_without_bias(client):
    layer = Dense(7, "tanh", bias=False)
    report = check_layer(client, layer, 13, grids=GRIDS, steps=1)
    assert list(report) == GRIDS and _checked(report) == report
    _assert_exact(report, 3)  # front Dense(13), the layer, the head
    errors = report["2x2"]
    assert "db1" not in errors and "db0" in errors  # no bias: nothing compared for it
    front, mine, head = errors["network"]
    assert mine is layer and front == Dense(13) and head == Dense(4)


def test_conv_with_stride_and_asymmetric_padding(client):
    layer = Conv2d(3, (3, 2), stride=2, padding=(1, 0, 1, 1), activation="relu")
    report = check_layer(client, layer, (2, 9, 5), grids=GRIDS, steps=1)
    assert _checked(report) == report
    _assert_exact(report, 3)  # front 1x1 conv, the layer, the head
    assert report["2x1"]["network"][1] is layer
    assert isinstance(report["2x1"]["network"][2], Flatten)


def test_pooling_layer(client):
    layer = MaxPool2d(3, stride=2, padding=1)
    report = check_layer(client, layer, (2, 7, 6), grids=GRIDS, steps=1)
    assert _checked(report) == report
    _assert_exact(report, 2)  # front 1x1 conv, the head (the pooling has no weights)


def test_default_grids_are_every_factorization_that_fits(client):
    # 8 workers: 20 grids; Dense(2) on 2 features leaves Pr <= 2 and Pc <= 3 (its weight
    # columns: 2 inputs + bias; the head's: 2 outputs + bias)
    report = check_layer(client, Dense(2, "tanh"), 2, steps=1)
    assert len(report) == 20
    assert list(_checked(report)) == ["1x1", "1x2", "2x1", "1x3", "2x2", "2x3"]
    _assert_exact(report, 3)
    assert "2 outputs, fewer than the grid's Pr = 4" in report["4x1"]["skipped"]
    assert "layer 0 is yours" in report["4x1"]["skipped"]
    assert "3 weight columns" in report["1x4"]["skipped"]


def test_grids_that_do_not_fit_are_skipped(client):
    # padded 2x2 pooling with stride 1 turns 2 rows into 3: Pr <= 3, but the 1x1 conv in
    # front keeps 2 rows (Pr <= 2), so 3x1 runs without it; 16 cells are more than 8 workers
    report = check_layer(client, AvgPool2d(2, stride=1, padding=1), (1, 2, 3),
                         grids=["1x1", "3x1", "4x1", "4x4"], steps=1)
    assert list(report) == ["1x1", "3x1", "4x1", "4x4"]
    assert set(_checked(report)) == {"1x1", "3x1"}
    assert len(report["1x1"]["network"]) == 4 and len(report["3x1"]["network"]) == 3
    _assert_exact({"1x1": report["1x1"]}, 2)
    _assert_exact({"3x1": report["3x1"]}, 1)
    assert "3 output rows, fewer than the grid's Pr = 4" in report["4x1"]["skipped"]
    assert "16 workers; the cluster has 8" in report["4x4"]["skipped"]


def test_a_wrong_kernel_is_caught(client):
    """Pooling's backward, off by 1e-9 on the workers, fails the check: the 1x1 conv in
    front is what makes the engine compute it (a network's first layer needs no dX)."""

    def patch(skew):  # runs on each worker: skew its kernel, or (None) restore it
        import dask_ipar.kernels.conv as ck

        if skew is None:
            ck.pool_block_backward = ck.__dict__.pop("_real_pool_block_backward",
                                                     ck.pool_block_backward)
            return
        real = ck.__dict__.setdefault("_real_pool_block_backward", ck.pool_block_backward)
        ck.pool_block_backward = lambda *a: real(*a) * (1 + skew)

    layer = MaxPool2d(2)
    client.run(patch, 1e-9)
    try:
        wrong = r"fails on 2 of 2 grids(.|\n)*grid 2x1: dW0 differs from the reference"
        with pytest.raises(AssertionError, match=wrong):
            check_layer(client, layer, (1, 6, 4), grids=["1x1", "2x1"], fd_eps=None, steps=1)
        # without the front layer the broken backward never runs
        check_layer(client, layer, (1, 6, 4), grids=["2x1"], input_gradient=False, steps=1)
    finally:
        client.run(patch, None)
    check_layer(client, layer, (1, 6, 4), grids=["2x1"], steps=1)  # restored: passes again


@pytest.mark.parametrize("layer, shape, message", [
    ("Dense(8)", 4, "takes a dask_ipar Dense, Conv2d"),
    (Dense, 4, "got the class Dense; create one"),
    ([Dense(4), Dense(2)], 4, "checks one layer, got a list"),
    (Flatten(), (1, 4, 4), "Flatten\\(\\) has no computation"),
    (Dense(4), (1, 4, 4), "number of input features.*an image shape"),
    (Dense(4), 0, "number of input features"),
    (Conv2d(2), 16, r"takes images: input_shape=\(channels, height, width\)"),
    (MaxPool2d(2), (4, 4), r"takes images"),
    (Conv2d(2, groups=2), (3, 4, 4), "does not take images of input_shape=\\(3, 4, 4\\).*groups"),
    (MaxPool2d(5), (1, 3, 3), "too small for a 5x5 window"),
])
def test_bad_layer_or_input_shape(client, layer, shape, message):
    with pytest.raises(IparError, match=message):
        check_layer(client, layer, shape, grids=["1x1"])


@pytest.mark.parametrize("kwargs, message", [
    ({"grids": "2by2"}, "grids\\[0\\] = '2by2': grid '2by2' is not of the form PRxPC"),
    ({"grids": ["1x1", "0x2"]}, "grids\\[1\\].*positive integer"),
    ({"grids": []}, "non-empty list of grids"),
    ({"grids": 4}, "non-empty list of grids"),
    ({"grids": ["8x1"]}, "no grid fits Dense.*8x1: layer 0 has 2 outputs"),
    ({"dtype": "float32"}, "dtype must be 'float64'"),
    ({"batch": 0}, "batch must be a positive integer"),
    ({"classes": 1}, "classes must be an integer >= 2"),
])
def test_bad_arguments(client, kwargs, message):
    with pytest.raises(IparError, match=message):
        check_layer(client, Dense(2), 4, **kwargs)
