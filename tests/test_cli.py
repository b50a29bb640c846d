"""``dask-ipar train``: the main job, end to end, in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _train(*args, timeout=300):
    proc = subprocess.run([sys.executable, "-m", "dask_ipar.cli", "train", *args],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(proc.stdout.strip().splitlines()[-1])


def test_train_defaults_reach_95_percent_on_digits():
    proc, out = _train("--json")
    for key in ("grid", "test_accuracy", "epochs", "seconds", "samples_per_s"):
        assert key in out
    assert out["test_accuracy"] >= 0.95, out
    assert out["epochs"] == 10 and out["executor"] == "programs"
    assert out["steps_per_program"] == 16  # auto: the digits MLP's step is microseconds
    # predicted beside measured communication, per layer and phase
    comm = out["comm"]
    assert {c["phase"] for c in comm} >= {"fwd_gather", "dw_reduce", "w_gather"}
    for c in comm:
        assert set(c) >= {"layer", "phase", "predicted_bytes", "measured_bytes",
                          "predicted_s", "measured_s"}
        assert c["measured_bytes"] == pytest.approx(c["predicted_bytes"], rel=0.02)
    # the scheduler's address and a dashboard link that opens where the server listens
    assert "dask-ipar: scheduler tcp://127.0.0.1:" in proc.stderr
    assert "; dashboard http://127.0.0.1:" in proc.stderr
    assert "test accuracy" in proc.stderr


def test_train_on_existing_scheduler(client, tmp_path, capsys):
    from dask_ipar.cli.main import main

    address = client.scheduler.address
    card = tmp_path / "run.html"
    rc = main(["train", "--scheduler-address", address, "--grid", "2x1", "--epochs", "1",
               "--batch", "128", "--no-progress", "--json", "--report", str(card),
               "--executor", "graph", "--steps-per-program", "3"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-3000:]
    out = json.loads(captured.out.strip().splitlines()[-1])
    # a joined cluster: its address, and a dashboard link only where a page answers
    import urllib.error
    import urllib.request

    line = captured.err.split("dask-ipar: scheduler ")[1].splitlines()[0]
    assert line.startswith(address)
    port = client.scheduler_info()["services"]["dashboard"]
    try:
        serves = urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5).status
    except urllib.error.URLError:
        serves = None
    assert (f"; dashboard http://127.0.0.1:{port}/status" in line) == (serves == 200), line
    html = card.read_text()
    assert "comm-table" in html and "dense0" in html
    from dask_ipar.runtime.cluster import _has_bokeh

    if _has_bokeh():  # dask's report beside the card, calling code: the command typed
        dask_html = (tmp_path / "run.dask.html").read_text()
        assert "run.dask.html" in html
        assert "dask-ipar train --scheduler-address" in dask_html
        assert "performance_report_beside" not in dask_html
    assert out["grid"] == "2x1" and out["executor"] == "graph"
    assert out["steps_per_program"] == 3
    assert out["test_accuracy"] > 0.5, out
    # the shared cluster keeps running: our own client still works
    assert client.submit(sum, [1, 2]).result() == 3


def test_help_lists_subcommands():
    proc = subprocess.run([sys.executable, "-m", "dask_ipar.cli", "--help"],
                          capture_output=True, text=True)
    assert proc.returncode == 0
    assert "train" in proc.stdout and "plan" in proc.stdout


def test_conv_auto_with_a_calibrated_machine_picks_by_simulated_step(client, tmp_path):
    """``--conv auto --machine FILE`` with flop rates: the grid and conv schemes with the
    shortest simulated step (``rank_grids``), said on one line."""
    from dask_ipar.cost import Machine, save_machine

    mfile = tmp_path / "machine.yaml"
    m = Machine(alpha_s=5e-3, bandwidth_Bps=3e8, flops_per_s=5e10, cluster_flops_per_s=8e10,
                message_s=3e-4, round_s=0.01)
    save_machine(m, mfile)
    proc, out = _train("--scheduler-address", client.scheduler.address, "--model", "cnn",
                       "--conv", "auto", "--workers", "2", "--epochs", "1", "--no-progress",
                       "--machine", str(mfile), "--json")
    line = next(x for x in proc.stderr.splitlines() if "planner (conv auto)" in x)
    assert "simulated step" in line and str(mfile) in line, line
    assert "grid 1x2," in line or "grid 2x1," in line, line
    assert out["test_accuracy"] > 0.1, out  # it trains on the grid it picked


def test_train_cnn_on_digits(client):
    """``--model cnn --conv auto``: the planner picks each conv layer's scheme on 2x1.

    Two epochs keep the suite short (0.81 measured); the default 10 epochs reach 0.97
    (docs/conv.md).
    """
    proc, out = _train("--scheduler-address", client.scheduler.address, "--model", "cnn",
                       "--conv", "auto", "--grid", "2x1", "--epochs", "2", "--no-progress",
                       "--json")
    assert out["test_accuracy"] >= 0.7, out  # it learns (chance: 0.1)
    assert "planner (conv auto): grid 2x1, conv0 " in proc.stderr
    assert "machine alpha 0.001 s, 1e+09 B/s (the loopback default" in proc.stderr
    phases = {(c["layer"], c["phase"]) for c in out["comm"]}
    assert ("flatten4", "redistribute") in phases
    for c in out["comm"]:
        assert c["measured_bytes"] == pytest.approx(c["predicted_bytes"], rel=0.02)
    assert "CNN conv 16-32" in proc.stderr
