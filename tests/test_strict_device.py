"""The device path of the engine, end to end on CPU, with ``array_api_strict`` blocks.

``device="cuda"`` makes every block a CuPy array: the batch and the weights are copied to
the device by their owners, every kernel and collective then runs on device arrays, and
results come back through :func:`dask_ipar.kernels.blocks.to_host`. Here the same code path runs
with ``array_api_strict`` as the device module, which rejects anything outside the array
API standard (NumPy-only functions, methods, implicit conversions). A model that trains
exactly on it uses only what CuPy also provides, and nothing in a step silently falls
back to NumPy (a strict block given to a NumPy function raises).
"""

from __future__ import annotations

import numpy as np
import pytest

from dask_ipar.kernels import blocks as B
from dask_ipar.testing import check_cnn, check_mlp

pytest.importorskip("array_api_strict")


@pytest.fixture
def strict_device(monkeypatch):
    monkeypatch.setitem(B.DEVICE_MODULES, "strict", "array_api_strict")
    return "strict"


@pytest.mark.parametrize("grid", ["1x1", "2x2"])
def test_mlp_on_strict_blocks(client, strict_device, grid):
    check_mlp(client, grid, steps=4, device=strict_device)


@pytest.mark.parametrize("grid", ["1x1", "2x2"])
def test_cnn_on_strict_blocks(client, strict_device, grid):
    check_cnn(client, grid, fd_eps=None, device=strict_device)


def test_blocks_really_are_strict(client, strict_device):
    from dask_ipar import Dense, Sequential

    m = Sequential([Dense(9, "relu"), Dense(4)], input_dim=6, device=strict_device)
    m.distribute(client, "2x1")
    try:
        m.fit(np.ones((8, 6)), np.arange(8) % 4, epochs=1, batch_size=4)
        mine = f"-{m.uid}-"  # this model's blocks: other models' (an earlier test's, on the
        # shared cluster) may still be on the workers
        kinds = client.run(lambda dask_worker=None: sorted(
            {type(v).__module__.split(".")[0] for k, v in dask_worker.data.items()
             if isinstance(k, tuple) and ".w-" in str(k[0]) and mine in str(k[0])}))
        used = [k for k in kinds.values() if k]
        assert used and all(k == ["array_api_strict"] for k in used), kinds
        assert all(isinstance(W, np.ndarray) for W, _ in m.get_weights())
    finally:
        m.close()


def test_unknown_device_is_a_clear_error():
    from dask_ipar import Dense, IparError, Sequential

    with pytest.raises(IparError, match=r"device must be 'cpu' or 'cuda', got 'tpu'"):
        Sequential([Dense(4)], input_dim=3, device="tpu")


def test_batch_parallel_conv_front_on_strict_blocks(client, strict_device):
    """Convs that split the batch: the first dense layer's input gradient goes back by
    samples (one product per cell, cut per owner), on strict blocks too."""
    from dask_ipar import Conv2d
    from dask_ipar.testing import check_layer

    check_layer(client, Conv2d(3, 3, parallel="batch"), (2, 4, 4), grids=["2x2"],
                device=strict_device)
