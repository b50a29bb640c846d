"""Batch placement: embedded in the step graph (labels inlined) or scattered to the cells."""

from __future__ import annotations

import numpy as np
import pytest

from dask_ipar import SGD, Dense, Sequential
from dask_ipar import reference as R


def _reference_steps(params, acts, batches, opt):
    vel = [None] * len(params)
    losses = []
    for Xb, yb in batches:
        loss, _, grads = R.mlp_loss_and_grads(params, acts, Xb.T, yb)
        params, vel = R.sgd_step(params, vel, grads, opt.lr, opt.momentum, opt.weight_decay)
        losses.append(loss)
    return params, losses


@pytest.mark.parametrize("embed", [True, False], ids=["embedded", "scattered"])
def test_batch_paths_match_reference(client, embed, monkeypatch):
    rng = np.random.default_rng(5)
    X = rng.standard_normal((30, 9))
    y = rng.integers(0, 4, 30)
    batches = [(X[k:k + 10], y[k:k + 10]) for k in (0, 10, 20)]
    opt = SGD(lr=0.1, momentum=0.9, weight_decay=1e-3)
    model = Sequential([Dense(8, "relu"), Dense(6, "tanh"), Dense(4)], input_dim=9,
                       dtype="float64", seed=2)
    model.embed_bytes = 2**20 if embed else 0
    model.distribute(client, "2x2")
    submitted = []  # the key names of every submitted step graph
    submit = model._submit
    monkeypatch.setattr(model, "_submit", lambda g, *a, **kw: (
        submitted.append({k[0].split("-")[0] for k in g.dsk}), submit(g, *a, **kw))[1])
    try:
        start = model.get_weights()
        losses = []
        for Xb, yb in batches:
            futs = model.train_step(Xb, yb, opt)
            if embed:  # labels are arguments of the loss tasks; feature blocks are keys
                assert "input.x" in submitted[-1] and "input.y" not in submitted[-1]
            else:  # both scattered to the cells before the graph is submitted
                assert "input.x" not in submitted[-1]
            loss_sum, _ = np.sum(client.gather(futs), axis=0)
            losses.append(loss_sum / len(yb))
        want, want_losses = _reference_steps(start, ["relu", "tanh", "linear"], batches, opt)
        np.testing.assert_allclose(losses, want_losses, rtol=1e-12)
        for (W, b), (Wr, br) in zip(model.get_weights(), want):
            np.testing.assert_allclose(W, Wr, rtol=1e-12, atol=1e-14)
            np.testing.assert_allclose(b, br, rtol=1e-12, atol=1e-14)
    finally:
        model.close()
