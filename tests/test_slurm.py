"""End-to-end on a real one-node SLURM (started by ``.ci/slurm start``): worker processes
are batch jobs that sbatch submits, the scheduler runs in the command's process.

Marked ``slurm``; skipped where no SLURM node is idle (``sinfo``) or dask-jobqueue is
missing. Each run asks for one-core jobs of 1 GiB, so a 2x2 grid fits a 2-core machine
(the CI partition oversubscribes each core twice).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

pytestmark = pytest.mark.slurm

CONFIG = """\
cluster:
  kind: slurm
  memory: 1GiB
  walltime: "00:20:00"
  wait_timeout: 120
"""


def _slurm_idle() -> bool:
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return False
    try:
        import dask_jobqueue  # noqa: F401 (needed by --cluster slurm)
    except ImportError:
        return False
    try:
        # (without a controller sinfo retries for about 10 s)
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True,
                             text=True, timeout=3).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return False
    return any(s in ("idle", "mix", "alloc") for s in out)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A directory with a dask-ipar.yaml for the SLURM cluster (tests run commands there)."""
    if not _slurm_idle():
        pytest.skip("no idle SLURM node (run `.ci/slurm start` as root)")
    d = tmp_path_factory.mktemp("slurm")
    (d / "dask-ipar.yaml").write_text(CONFIG)
    yield d
    subprocess.run(["scancel", "--user", os.environ.get("USER", "root")], capture_output=True)


def _jobs() -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    return out.split()


def _no_jobs_left(within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while _jobs():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def _cli(cwd, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dask_ipar.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def _json(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


class _Run:
    """A command running in the background, its stderr collected line by line."""

    def __init__(self, cwd, *args):
        self.proc = subprocess.Popen([sys.executable, "-m", "dask_ipar.cli", *args], cwd=cwd,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in ln for ln in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"{text!r} never printed:\n{''.join(self.lines)[-3000:]}")
            time.sleep(0.1)

    def finish(self, timeout: float = 300.0):
        out = self.proc.stdout.read()
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return rc, out, "".join(self.lines)


# 44 steps of 128 samples: >= 0.95 on digits in the fewest steps
MLP = ("--epochs", "4", "--batch", "128", "--no-progress", "--json")
MLP_2X1 = ("--grid", "2x1", "--dtype", "float64", *MLP)


@pytest.fixture(scope="module")
def two_per_job(slurm):
    """A directory whose config puts two worker processes in each job (named
    ``SLURMCluster-0-0``, ``SLURMCluster-0-1``: the job's name plus a suffix)."""
    d = slurm / "two-per-job"
    d.mkdir()
    (d / "dask-ipar.yaml").write_text(CONFIG.replace("memory: 1GiB", "memory: 2GiB")
                                      + "  processes: 2\n  cores: 2\n")
    return d


@pytest.fixture(scope="module")
def reference_2x1(two_per_job):
    """An uninterrupted float64 2x1 MLP run on one SLURM job of two worker processes."""
    return _json(_cli(two_per_job, "train", *MLP_2X1))


def test_train_2x1_and_2x2_on_slurm_jobs(slurm, reference_2x1):
    out = reference_2x1
    assert out["grid"] == "2x1" and out["test_accuracy"] >= 0.95, out  # one job, 2 workers
    proc = _cli(slurm, "train", "--grid", "2x2", *MLP)
    out = _json(proc)
    assert out["grid"] == "2x2" and out["test_accuracy"] >= 0.95, out
    for c in out["comm"]:  # the engine's bytes between batch jobs as the model predicts
        assert c["measured_bytes"] == pytest.approx(c["predicted_bytes"], rel=0.02), c
    assert "submitting 4 slurm job(s) for 4 workers" in proc.stderr
    # the scheduler's address, and the dashboard where it listens (with the ssh tunnel)
    assert "dask-ipar: scheduler tcp://" in proc.stderr
    assert "; dashboard http://127.0.0.1:" in proc.stderr and "ssh -L" in proc.stderr
    assert _no_jobs_left()


def test_cnn_on_slurm_jobs(slurm):
    out = _json(_cli(slurm, "train", "--model", "cnn", "--grid", "2x1", "--epochs", "1",
                     "--no-progress", "--json"))
    assert out["grid"] == "2x1" and out["test_accuracy"] > 0.3, out  # 1 epoch; chance 0.1
    phases = {c["phase"] for c in out["comm"]}
    assert "halo_fwd" in phases, phases  # domain parallel across the two jobs
    for c in out["comm"]:
        assert c["measured_bytes"] == pytest.approx(c["predicted_bytes"], rel=0.02), c


def test_scancelled_worker_job_is_replaced_and_the_run_ends_as_uninterrupted(
        two_per_job, reference_2x1):
    run = _Run(two_per_job, "train", *MLP_2X1, "--checkpoint-dir", "ck",
               "--checkpoint-every", "10")
    run.wait_for("checkpoint ck/ckpt-20")
    jobs = _jobs()
    assert len(jobs) == 1, jobs  # both grid cells in one job
    subprocess.run(["scancel", jobs[0]], check=True)
    rc, out, err = run.finish()
    assert rc == 0, err[-3000:]
    # scancel's SIGTERM reaches the workers first: the run saves the step it is on before
    # they go (dask_ipar.runtime.preempt), and recovers from that step: none runs twice
    left = re.search(r"step (\d+): grid worker\(s\) .* leaving \((SIGTERM|its nanny is "
                     r"closing)[^)]*\); their state is in ck/ckpt-(\d+)", err)
    assert left and left[1] == left[3], err[-3000:]
    assert f"resuming after step {left[1]} from ck/ckpt-{left[1]}" in err, err[-3000:]
    assert "ended: submitting replacement" in err, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    # float64, same seed: the recovered run is the uninterrupted one, bit for bit
    assert got["test_loss"] == reference_2x1["test_loss"]
    assert got["train_loss"] == reference_2x1["train_loss"]
    assert _no_jobs_left()


def test_rejected_submission_is_one_line_at_once(slurm, tmp_path):
    (tmp_path / "dask-ipar.yaml").write_text(CONFIG + "  queue: nosuch\n")
    t0 = time.monotonic()
    proc = _cli(tmp_path, "train", "--grid", "2x1", "--epochs", "1", timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert took < 60, took
    assert "Traceback" not in proc.stderr and "tornado" not in proc.stderr, proc.stderr
    err = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(err) == 1, proc.stderr
    # sbatch's own words, and the setting to change
    assert "sbatch refused the worker job: invalid partition specified: nosuch" in err[0]
    assert "cluster.queue" in err[0]
    assert _no_jobs_left()


def test_ctrl_c_exits_130_and_cancels_the_jobs(slurm):
    run = _Run(slurm, "train", "--grid", "2x1", "--epochs", "200", "--no-progress",
               "--checkpoint-dir", "ck-int")
    run.wait_for("dask-ipar: scheduler")
    time.sleep(2.0)  # into the training loop
    run.proc.send_signal(signal.SIGINT)
    rc, _, err = run.finish(timeout=120)
    assert rc == 130, err[-3000:]
    assert "stopped by SIGINT after step" in err and "continue with --resume" in err, err
    assert _no_jobs_left()


def test_batch_workers_get_their_cores_prologue_python_and_log_directory(slurm, tmp_path):
    import copy

    from dask_ipar.config import DEFAULTS
    from dask_ipar.runtime.cluster import dashboard_link, make_cluster

    cfg = copy.deepcopy(DEFAULTS)
    logs = tmp_path / "logs"
    cfg["cluster"].update(kind="slurm", memory="1GiB", cores=2, processes=1,
                          wait_timeout=120, python=sys.executable, log_directory=str(logs),
                          job_script_prologue=["export IPAR_PROLOGUE_RAN=yes"])
    with make_cluster(cfg, 1) as client:
        env = list(client.run(lambda: {k: os.environ.get(k) for k in (
            "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
            "IPAR_PROLOGUE_RAN")}).values())[0]
        threads = list(client.nthreads().values())
        exe = list(client.run(lambda: sys.executable).values())[0]
        link = dashboard_link(client)
    assert env == {"OMP_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "2",
                   "MKL_NUM_THREADS": "2", "IPAR_PROLOGUE_RAN": "yes"}, env
    assert threads == [2] and exe == sys.executable
    assert link.startswith("http://127.0.0.1:")  # where the scheduler's dashboard listens
    assert any(p.suffix == ".err" for p in logs.iterdir()), list(logs.iterdir())
    assert _no_jobs_left()


def test_verify_and_calibrate_run_on_the_configured_batch_system(slurm):
    proc = _cli(slurm, "verify", "--grid", "2x1", "--cluster", "slurm")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "submitting 2 slurm job(s)" in proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("PASS in"), proc.stdout
    # calibrate reads cluster.kind from ./dask-ipar.yaml
    proc = _cli(slurm, "calibrate", "-o", "machine.yaml", "--json", "--quick")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "submitting 2 slurm job(s)" in proc.stderr
    machine = json.loads(proc.stdout.strip().splitlines()[-1])
    assert machine["alpha_s"] > 0 and machine["bandwidth_Bps"] > 0
    assert (slurm / "machine.yaml").is_file()
    assert _no_jobs_left()
