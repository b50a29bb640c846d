"""The bad inputs users met with ``dask-ipar train``: each ends in one line that names the
flag as typed (or the data file), what was expected and the fix, with exit 2 and no
traceback, before any cluster starts."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import dask
import distributed  # noqa: F401 (its defaults join dask.config on import: keep them)
import numpy as np
import pytest


ARGS = ("train", "--no-progress", "--no-dashboard", "--epochs", "1")


def _train(*args, timeout=120):
    """``dask-ipar train`` in a subprocess (for runs that start a cluster)."""
    return subprocess.run([sys.executable, "-m", "dask_ipar.cli", *ARGS, *args],
                          capture_output=True, text=True, timeout=timeout)


def _train_here(capsys, *args):
    """``dask-ipar train`` in this process (most runs end in the checks, before any cluster
    starts; the others join the session's)."""
    from dask_ipar.cli.main import main

    saved = copy.deepcopy(dask.config.config)  # the command registers its settings there
    try:
        code = main([*ARGS, *args])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    finally:
        dask.config.config.clear()
        dask.config.config.update(saved)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def _one_line_error(proc, *needles):
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = err[-1]
    assert last.startswith("dask-ipar train: error: "), err
    for n in needles:
        assert n in last, (n, last)
    assert not any("dask-ipar: MLP" in line for line in err), "a cluster was started"
    return last


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    rng = np.random.default_rng(0)
    X = rng.standard_normal((60, 8))
    y = rng.integers(0, 3, 60)
    y1000 = y.copy()
    y1000[0] = 1000
    np.savez(d / "label1000.npz", X=X, y=y1000)
    np.savez(d / "five.npz", X=X[:5], y=y[:5])
    np.savez(d / "ok.npz", X=X, y=y)
    (d / "text.npz").write_text("hello\n")
    return d


@pytest.mark.parametrize("args,needles", [
    (["--batch", "100000"], ["--batch 100000 is larger than the", "training samples",
                             "use --batch"]),
    (["--hidden", ""], ["--hidden", "names no width", "'none' for no hidden layer"]),
    (["--grid", "3"], ["--grid 3: expected PRxPC such as 2x2"]),
    (["--scheduler-address", "notanaddress"], ["--scheduler-address notanaddress: expected a "
                                               "scheduler address such as tcp://"]),
    (["--resume", "--checkpoint-dir", "{tmp}/nothing-here"], ["--resume:", "does not exist",
                                                              "Drop --resume"]),
    (["--lr-schedule", "cosine:x"], ["--lr-schedule cosine:x: expected none, step:N",
                                     "warmup:N+cosine"]),
    (["--early-stopping", "3"], ["--early-stopping 3 watches the validation loss",
                                 "add --val-fraction"]),
    (["--val-fraction", "1.5"], ["--val-fraction", "expected a fraction in [0, 1)"]),
    (["--optimizer", "lbfgs"], ["--optimizer", "invalid choice: 'lbfgs'"]),
    (["--steps-per-program", "17"], ["--steps-per-program", "expected a whole number from 1 "
                                    "to 16, or auto, got '17'"]),
], ids=["batch-too-large", "hidden-empty", "grid-malformed", "scheduler-address",
        "resume-nothing", "schedule-malformed", "early-stopping-without-validation",
        "val-fraction-range", "optimizer-unknown", "steps-per-program-range"])
def test_flag_errors(args, needles, tmp_path, capsys):
    _one_line_error(_train_here(capsys, *[a.format(tmp=tmp_path) for a in args]), *needles)


@pytest.mark.parametrize("name,needles", [
    ("label1000.npz", ["the labels run up to 1000", "only 4 distinct labels", "0..K-1"]),
    ("five.npz", ["5 samples leave 1 in the test split", "fewer than the grid's 2",
                  "at most 1 column (e.g. --grid 1x1)"]),
    ("text.npz", ["is not a file of numeric NumPy arrays", "numpy.savez"]),
])
def test_data_errors(files, name, needles, capsys):
    last = _one_line_error(_train_here(capsys, "--data", str(files / name)), f"{name}",
                           *needles)
    assert "allow_pickle" not in last and "x_key=" not in last


def test_resume_with_other_settings_is_refused_unless_allowed(files, tmp_path, capsys, client):
    ck = tmp_path / "ck"
    base = ["--data", str(files / "ok.npz"), "--batch", "8", "--checkpoint-dir", str(ck)]
    first = _train(*base)  # a command that starts its own cluster
    assert first.returncode == 0, first.stderr[-2000:]
    changed = _train_here(capsys, *base, "--resume", "--lr", "0.2", "--batch", "16",
                          "--optimizer", "adamw")
    last = _one_line_error(changed,
                           "--optimizer adamw (the checkpoint's run used sgd)",
                           "--lr 0.2 (the checkpoint's run used 0.05)",
                           "--batch 16 (the checkpoint's run used 8)", "--resume-changed")
    assert "--seed" not in last
    allowed = _train_here(capsys, *base, "--resume", "--lr", "0.2", "--resume-changed",
                          "--json", "--scheduler-address", client.scheduler.address)
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    # resumed at its last step, the run made no step: no samples/s from the first run's
    summary = json.loads(allowed.stdout.strip().splitlines()[-1])
    assert summary["samples_per_s"] == 0


def test_matmul_setting_errors(tmp_path, capsys, monkeypatch):
    """``matmul`` from the config file: a bad value, and ``torch`` without PyTorch, end
    before a cluster starts, naming the setting and where to set it."""
    import importlib.util

    cfg = tmp_path / "dask-ipar.yaml"
    cfg.write_text("matmul: mkl\n")
    _one_line_error(_train_here(capsys, "--config", str(cfg)),
                    "config matmul is 'mkl', expected auto (PyTorch's BLAS on Intel CPUs "
                    "where installed), numpy or torch")
    cfg.write_text("matmul: torch\n")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    _one_line_error(_train_here(capsys, "--config", str(cfg)), "matmul: torch needs PyTorch",
                    "pip install torch", "DASK_IPAR__MATMUL")
