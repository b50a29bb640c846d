"""The kernels' products (:mod:`dask_ipar.kernels.blas`): PyTorch's BLAS on NumPy blocks
against NumPy's own products, the ``matmul`` setting, and whole grids against the NumPy
reference with every product on PyTorch's BLAS."""

from __future__ import annotations

import importlib.util
import os
import re

import dask
import numpy as np
import pytest

from dask_ipar.config import ConfigError, DEFAULTS, validate
from dask_ipar.errors import IparError
from dask_ipar.kernels import blas
from dask_ipar.layout.grid import Grid
from dask_ipar.testing import check_cnn, check_mlp


@pytest.fixture
def torch_calls(monkeypatch):
    """The products PyTorch ran: a list that grows by one for each ``torch.matmul``."""
    torch = pytest.importorskip("torch")
    calls = []
    real = torch.matmul

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "matmul", counted)
    return calls


def _rand(*shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-4), (np.float64, 1e-12)])
def test_torch_products_equal_numpy(torch_calls, dtype, tol):
    a, b = _rand(300, 500, dtype=dtype), _rand(200, 500, dtype=dtype, seed=1)
    ref = a @ b.T
    scale = np.abs(ref).max()
    with dask.config.set({"ipar.matmul": "torch"}):
        r = blas.matmul(a, b.T)  # a transposed operand, no copy
        assert type(r) is np.ndarray and r.dtype == dtype and r.flags.c_contiguous
        assert np.abs(r - ref).max() <= tol * scale
        out = np.full((300, 260), 7, dtype)  # into the first columns of a wider array
        assert blas.matmul(a, b.T, out=out[:, :200]) is not None
        assert np.abs(out[:, :200] - ref).max() <= tol * scale and (out[:, 200:] == 7).all()
        a.flags.writeable = False  # as blocks received over the network are
        assert np.abs(blas.matmul(a, b.T) - ref).max() <= tol * scale
        w, cols = _rand(16, 27, dtype=dtype), _rand(8, 27, 4096, dtype=dtype)  # conv: batched
        r = blas.matmul(w, cols)
        assert r.shape == (8, 16, 4096) and np.abs(r - w @ cols).max() <= tol * 20
    assert len(torch_calls) == 4


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-4), (np.float64, 1e-12)])
def test_matmul_add_adds_into_its_output(monkeypatch, dtype, tol):
    """``c += a @ b``: on PyTorch's BLAS inside the product (``addmm_``, no scratch), on
    NumPy's into the scratch it hands back for the next call; both equal NumPy's sum."""
    torch = pytest.importorskip("torch")
    a, b, c0 = _rand(300, 500, dtype=dtype), _rand(500, 200, dtype=dtype, seed=1), \
        _rand(300, 200, dtype=dtype, seed=2)
    ref = c0 + a @ b
    scale = np.abs(ref).max()
    added = []
    real = torch.Tensor.addmm_
    monkeypatch.setattr(torch.Tensor, "addmm_", lambda t, *x: added.append(1) or real(t, *x))
    with dask.config.set({"ipar.matmul": "torch"}):
        c = c0.copy()
        r, tmp = blas.matmul_add(c, a, b)
        assert r is c and tmp is None and added == [1]
        assert np.abs(c - ref).max() <= tol * scale
        wide = np.zeros((300, 260), dtype)  # not C-contiguous: the product apart, then added
        r, tmp = blas.matmul_add(wide[:, :200], a, b)
        assert added == [1] and tmp.shape == (300, 200)
        assert np.abs(wide[:, :200] - a @ b).max() <= tol * scale and (wide[:, 200:] == 0).all()
        square = _rand(300, 300, dtype=dtype, seed=3)  # c overlapping an operand: apart
        r, tmp = blas.matmul_add(square, square, np.eye(300, dtype=dtype))
        assert added == [1] and np.abs(r - 2 * _rand(300, 300, dtype=dtype, seed=3)).max() \
            <= tol * 10
        c = c0.copy()  # negative strides, which PyTorch cannot view: apart
        r, tmp = blas.matmul_add(c, a[::-1], b)
        assert added == [1] and np.abs(c - (c0 + a[::-1] @ b)).max() <= tol * scale
    with dask.config.set({"ipar.matmul": "numpy"}):
        c = c0.copy()
        r, tmp = blas.matmul_add(c, a, b)
        assert r is c and tmp.shape == c.shape and added == [1]
        r, tmp2 = blas.matmul_add(c, a, b, tmp)  # the scratch reused
        assert tmp2 is tmp and np.abs(c - (ref + a @ b)).max() <= 2 * tol * scale


def test_what_stays_on_numpy(torch_calls):
    a, b = _rand(300, 500), _rand(500, 200)
    with dask.config.set({"ipar.matmul": "torch"}):
        small = _rand(16, 16)
        assert np.array_equal(blas.matmul(small, small), small @ small)  # below MIN_FLOPS
        rev = a[::-1]  # negative strides: PyTorch cannot view them
        assert np.array_equal(blas.matmul(rev, b), rev @ b)
        assert np.array_equal(blas.matmul(a.astype(np.float16), b.astype(np.float16)),
                              a.astype(np.float16) @ b.astype(np.float16))
    with dask.config.set({"ipar.matmul": "numpy"}):
        assert blas.backend() == "numpy"
        assert np.array_equal(blas.matmul(a, b), a @ b)
    assert torch_calls == []


def test_auto_and_the_setting(monkeypatch):
    with dask.config.set({"ipar.matmul": "auto"}):
        installed = importlib.util.find_spec("torch") is not None
        intel = blas.cpu_vendor() == "GenuineIntel"
        assert blas.backend() == ("torch" if installed and intel else "numpy")
        # by vendor, with PyTorch present or not (a stand-in: CI has no PyTorch)
        for torch, vendor, expected in ((object(), "GenuineIntel", "torch"),
                                        (object(), "AuthenticAMD", "numpy"),
                                        (object(), "", "numpy"),
                                        (None, "GenuineIntel", "numpy")):
            monkeypatch.setattr(blas, "cpu_vendor", lambda v=vendor: v)
            monkeypatch.setattr(blas, "_torch", lambda t=torch: t)
            assert blas.backend() == expected, (vendor, torch)
        monkeypatch.undo()
    assert DEFAULTS["matmul"] == "auto" and validate({**DEFAULTS, "matmul": "numpy"})
    with pytest.raises(ConfigError, match="matmul.*auto.*numpy or torch"):
        validate({**DEFAULTS, "matmul": "mkl"})
    with pytest.raises(IparError, match="not one of auto, numpy, torch"):
        blas.check_setting("mkl")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(IparError, match="needs PyTorch.*pip install torch.*auto or numpy"):
        blas.check_setting("torch")
    assert blas.check_setting("auto") == "auto"


def _workers_on_torch(client, min_flops):
    """Every worker's products on PyTorch down to ``min_flops`` (None: the default back);
    the products counted in each worker's ``_ipar_torch_products``."""
    def setup(min_flops):
        import torch

        from dask_ipar.kernels import blas as b

        if min_flops is None:
            torch.matmul = getattr(torch.matmul, "_real", torch.matmul)
            b.MIN_FLOPS = b.__dict__.get("_default_min", b.MIN_FLOPS)
            dask.config.set({"ipar.matmul": "auto"})
            return 0
        b.__dict__.setdefault("_default_min", b.MIN_FLOPS)
        b.MIN_FLOPS = min_flops
        dask.config.set({"ipar.matmul": "torch"})
        real = getattr(torch.matmul, "_real", torch.matmul)
        counter = [0]

        def counted(*args, **kwargs):
            counter[0] += 1
            return real(*args, **kwargs)

        counted._real, counted.counter = real, counter
        torch.matmul = counted
        return 0

    client.run(setup, min_flops)


def _torch_products(client) -> int:
    def count():
        import torch

        return getattr(torch.matmul, "counter", [0])[0]

    return sum(client.run(count).values())


@pytest.mark.parametrize("grid,executor", [(Grid(2, 2), "programs"), (Grid(2, 1), "graph"),
                                           (Grid(1, 3), "programs")], ids=str)
def test_grids_on_torch_blas_match_the_reference(client, grid, executor):
    pytest.importorskip("torch")
    _workers_on_torch(client, 0)
    try:
        check_mlp(client, grid, steps=3, executor=executor)  # float64: as tight as NumPy's
        assert _torch_products(client) > 0
    finally:
        _workers_on_torch(client, None)


def test_cnn_on_torch_blas_matches_the_reference(client):
    pytest.importorskip("torch")
    _workers_on_torch(client, 0)
    try:
        check_cnn(client, Grid(2, 2))
        assert _torch_products(client) > 0
    finally:
        _workers_on_torch(client, None)


def test_a_broken_pytorch_falls_back_under_auto(monkeypatch):
    """PyTorch installed but failing to import: ``auto`` multiplies with NumPy's BLAS,
    ``torch`` says why it cannot."""
    import sys

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "torch" else real(name, *a))
    monkeypatch.setitem(sys.modules, "torch", None)  # "import torch" raises ImportError
    monkeypatch.setattr(blas, "_torch_module", None)
    monkeypatch.setattr(blas, "_torch_error", None)
    monkeypatch.setattr(blas, "cpu_vendor", lambda: "GenuineIntel")  # where auto asks PyTorch
    a, b = _rand(300, 500), _rand(500, 200)
    with dask.config.set({"ipar.matmul": "auto"}):
        assert blas.backend() == "numpy"
        assert np.array_equal(blas.matmul(a, b), a @ b)
    with dask.config.set({"ipar.matmul": "torch"}):
        with pytest.raises(IparError, match="fails to import here .*Error: .*auto or numpy"):
            blas.matmul(a, b)


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="Linux's /proc/cpuinfo")
def test_cpu_vendor_reads_the_first_vendor_id():
    with open("/proc/cpuinfo") as f:
        vendors = re.findall(r"^vendor_id\s*:\s*(\S+)", f.read(), flags=re.M)
    assert vendors and blas.cpu_vendor() == vendors[0]
