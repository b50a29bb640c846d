"""The run card: content checked from the HTML (rendering in Chromium: test_dashboard.py)."""

from __future__ import annotations

import numpy as np
import pytest

from dask_ipar import Dense, Sequential
from dask_ipar.io.report import write_run_card
from htmltables import Tables as _Tables


@pytest.fixture(scope="module")
def card(client, tmp_path_factory):
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((40, 12)), rng.integers(0, 4, 40)
    model = Sequential([Dense(9, "relu"), Dense(4)], input_dim=12).distribute(client, "2x2")
    hist = model.fit(X, y, epochs=2, batch_size=20, validation_data=(X[:8], y[:8]))
    path = tmp_path_factory.mktemp("card") / "run.html"
    write_run_card(path, {"grid": "2x2", "test_accuracy": 0.5}, hist, model)
    model.close()
    return path, hist


def test_card_holds_the_predicted_vs_measured_table(card):
    path, hist = card
    parser = _Tables()
    parser.feed(path.read_text())
    comm = parser.tables["comm-table"]
    assert comm[0][:5] == ["layer", "phase", "predicted bytes", "measured bytes", "ratio"]
    body = comm[1:]
    assert len(body) == len(hist.comm.rows) == 7  # 2 layers: 3 + 4 phases
    for row, ref in zip(body, hist.comm.rows):
        assert row[0] == ref.layer and row[1] == ref.phase
        assert float(row[2]) == pytest.approx(ref.predicted_bytes, abs=0.5)
        assert float(row[3]) == pytest.approx(ref.measured_bytes, abs=0.5)
        assert float(row[4]) == pytest.approx(1.0, abs=0.02)
    assert [r[0] for r in parser.tables["layers"][1:]] == ["dense0", "dense1"]
    assert len(parser.tables["workers"]) == 1 + 4
    epochs = parser.tables["epochs"]  # the per-epoch record, validation included
    assert epochs[0][:5] == ["epoch", "loss", "accuracy", "val_loss", "val_accuracy"]
    assert [int(r[0]) for r in epochs[1:]] == [1, 2]
    for row, rec in zip(epochs[1:], hist.epochs):
        assert float(row[3]) == pytest.approx(rec["val_loss"], rel=1e-3)


# Rendering in headless Chromium: tests/test_dashboard.py (the run card of a 2x2 CNN).
