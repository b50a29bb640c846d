"""Bad input gets a clear error naming the problem and the fix; nothing is left running."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import numpy as np
import psutil
import pytest

from dask_ipar import Dense, Grid, IparError, Sequential, bind_grid
from dask_ipar.layout.grid import GridBinding, parse_grid


def _model(**kw):
    return Sequential([Dense(29, "relu"), Dense(13, "tanh"), Dense(10)], input_dim=37,
                      dtype="float64", **kw)


def _data(n=23, d=37, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, d)), rng.integers(0, 10, n)


def test_grid_larger_than_cluster(client):
    with pytest.raises(IparError, match=r"needs 9 workers but the cluster has 8.*--workers 9"):
        bind_grid(Grid(3, 3), client)
    with pytest.raises(IparError, match="needs 16 workers"):
        _model().distribute(client, "4x4")


def test_p_not_equal_pr_times_pc():
    with pytest.raises(IparError, match=r"P = 2\*2 = 4 workers, got 3"):
        GridBinding(Grid(2, 2), ("a", "b", "c"))
    with pytest.raises(IparError, match="not of the form PRxPC"):
        parse_grid("2by2")
    with pytest.raises(IparError, match="positive integer"):
        Grid(0, 2)


def test_batch_smaller_than_pc(client):
    X, y = _data()
    model = _model().distribute(client, "1x4")
    with pytest.raises(IparError, match=r"batch size 3 is smaller than the grid's Pc = 4"):
        model.fit(X, y, batch_size=3)
    model.close()


def test_labels_out_of_range(client):
    X, y = _data()
    y[5] = 10
    model = _model().distribute(client, "2x1")
    with pytest.raises(IparError, match=r"labels must lie in \[0, 10\).*got labels from 0 to 10"):
        model.fit(X, y, batch_size=8)
    y[5] = -1
    with pytest.raises(IparError, match="labels must lie"):
        model.evaluate(X, y)
    model.close()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_or_inf_inputs(client, bad):
    X, y = _data()
    X[4, 7] = bad
    model = _model().distribute(client, "1x2")
    with pytest.raises(IparError, match=r"NaN or inf \(first at sample 4, feature 7\)"):
        model.fit(X, y, batch_size=8)
    model.close()


def test_mismatched_layer_sizes(client):
    X, y = _data(d=36)
    model = _model().distribute(client, "2x2")
    with pytest.raises(IparError, match=r"X has 36 features but the model's first layer expects 37"):
        model.fit(X, y, batch_size=8)
    with pytest.raises(IparError, match=r"layer 1 \(dense1\): W has shape \(13, 28\), expected \(13, 29\)"):
        model.set_weights([(np.zeros((29, 37)), np.zeros(29)), (np.zeros((13, 28)), np.zeros(13)),
                           (np.zeros((10, 13)), np.zeros(10))])
    with pytest.raises(IparError, match="fewer than the grid's Pr = 4"):
        Sequential([Dense(3), Dense(10)], input_dim=5).distribute(client, "4x1")
    model.close()


def test_non_numeric_data(client):
    _, y = _data()
    X = np.array([["a"] * 37] * 23)
    model = _model().distribute(client, "1x1")
    with pytest.raises(IparError, match=r"X must be numeric, got dtype <U1"):
        model.fit(X, y)
    with pytest.raises(IparError, match="integer class labels"):
        model.fit(np.zeros((23, 37)), np.array(["x"] * 23))
    model.close()


def test_cluster_still_usable_after_errors(client):
    """The errors above left no broken state: a fresh model trains normally."""
    X, y = _data()
    model = _model().distribute(client, "2x2")
    hist = model.fit(X, y, epochs=2, batch_size=23)
    assert np.isfinite(hist.last["loss"])
    model.close()


# ------------------------------------------------------------------- command line
def _run_cli(args, timeout=120):
    """Run ``dask-ipar`` in a subprocess tagged by an environment marker."""
    marker = uuid.uuid4().hex
    env = dict(os.environ, DASK_IPAR_TEST_MARKER=marker)
    proc = subprocess.run([sys.executable, "-m", "dask_ipar.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, marker


def _leftovers(marker, wait_s=10.0):
    """Processes still carrying the marker (cluster workers inherit the environment)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for p in psutil.process_iter(["pid"]):
            try:
                if p.environ().get("DASK_IPAR_TEST_MARKER") == marker:
                    found.append(p)
            except (psutil.Error, OSError):
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def test_cli_p_not_equal_pr_times_pc():
    proc, marker = _run_cli(["train", "--grid", "2x2", "--workers", "3"])
    assert proc.returncode == 2
    assert "P = Pr*Pc = 4 cells but --workers is 3" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert _leftovers(marker) == []


def test_cli_unreachable_scheduler():
    proc, marker = _run_cli(["train", "--scheduler-address", "tcp://127.0.0.1:9",
                             "--connect-timeout", "2"])
    assert proc.returncode == 2
    assert "could not reach a dask scheduler at 'tcp://127.0.0.1:9'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert _leftovers(marker) == []


def test_cli_error_after_cluster_start_leaves_nothing_running():
    """A layer narrower than Pr fails once the LocalCluster is up: it must be shut down."""
    proc, marker = _run_cli(["train", "--grid", "2x1", "--hidden", "1", "--no-dashboard"])
    assert proc.returncode == 2, proc.stderr
    assert "fewer than the grid's Pr = 2 rows" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert _leftovers(marker) == []


def test_worker_lost_mid_training_stops_with_a_clear_error():
    """A SIGKILLed worker: fit stops with a message naming the cell and the way to resume."""
    import signal

    from distributed import Client, LocalCluster

    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((400, 37)), rng.integers(0, 10, 400)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as c:
        model = _model().distribute(c, "2x1")
        model.liveness_check_s = 1.0
        victim = model.binding.worker(1, 0)
        pid = c.run(os.getpid, workers=[victim])[victim]
        killed = []

        def kill_at_step_5(stats):
            if stats.step >= 5 and not killed:
                os.kill(pid, signal.SIGKILL)
                killed.append(stats.step)

        with pytest.raises(IparError, match=r"grid cell \(1, 0\) left the cluster.*--resume"):
            model.fit(X, y, epochs=20, batch_size=8, progress=kill_at_step_5)
        assert killed


@pytest.mark.faults
def test_cli_scheduler_lost_mid_run_is_one_line_naming_the_checkpoint(tmp_path):
    """An external scheduler killed mid-run: exit 2 with one line saying the scheduler is
    gone and which checkpoint to resume from; no traceback. (Its workers, an external
    cluster's, are stopped here.) A scheduler without a dashboard gets no link printed."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    dask_cli = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
    sched = subprocess.Popen([*dask_cli, "--host", "127.0.0.1", "--port", str(port),
                              "--no-dashboard"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    workers = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address,
                                "--nworkers", "2", "--nthreads", "1", "--no-dashboard"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ck = tmp_path / "ck"
    env = dict(os.environ, DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT="2s")
    run = None
    try:
        run = subprocess.Popen([sys.executable, "-m", "dask_ipar.cli", "train",
                                "--scheduler-address", address, "--grid", "2x1", "--epochs",
                                "50", "--no-progress", "--checkpoint-dir", str(ck),
                                "--checkpoint-every", "10"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + 120
        while not (ck / "ckpt-10").is_dir():
            assert run.poll() is None, run.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint at step 10"
            time.sleep(0.1)
        sched.kill()
        t0 = time.monotonic()
        _, err = run.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        for p in (run, sched):
            if p is not None and p.poll() is None:
                p.kill()
        if workers.poll() is None:
            workers.terminate()  # lets the nannies stop their worker processes
        workers.wait(timeout=30)
    assert run.returncode == 2, err[-3000:]
    assert took < 30, took
    assert "Traceback" not in err and "Failed to reconnect" not in err, err[-3000:]
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1, err[-3000:]
    assert f"the dask scheduler at {address} is gone" in errors[0]
    last = errors[0].split("the last checkpoint is ")[1].split(" ")[0]
    assert (ck / os.path.basename(last)).is_dir() and "--resume" in errors[0]
    line = next(ln for ln in err.splitlines() if ln.startswith("dask-ipar: scheduler"))
    assert "dashboard" not in line, line
