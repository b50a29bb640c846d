"""Clusters from the config: batch job scripts (no batch system needed) and local clusters."""

from __future__ import annotations

import copy
import logging

import pytest

from dask_ipar.runtime.cluster import job_script, jobqueue_kwargs, local_threads, make_cluster
from dask_ipar.config import DEFAULTS
from dask_ipar.errors import IparError


def _cfg(**cluster):
    cfg = copy.deepcopy(DEFAULTS)
    cfg["cluster"].update(cluster)
    return cfg


HPC = dict(queue="compute", account="proj42", walltime="02:30:00", cores=8, memory="32GiB",
           processes=2, job_extra=["--exclusive"])


def test_slurm_job_script_carries_resources():
    pytest.importorskip("dask_jobqueue")
    s = job_script(_cfg(kind="slurm", **HPC), n_workers=4)
    lines = s.splitlines()
    assert "#SBATCH -p compute" in lines
    assert "#SBATCH -A proj42" in lines
    assert "#SBATCH -t 02:30:00" in lines
    assert "#SBATCH --cpus-per-task=8" in lines
    assert "#SBATCH --mem=32G" in lines
    assert "#SBATCH --exclusive" in lines
    # 2 worker processes per job, 8 cores shared: 4 threads each, memory split
    assert "--nworkers 2" in s and "--nthreads 4" in s and "--memory-limit 16.00GiB" in s


def test_pbs_job_script_carries_resources():
    pytest.importorskip("dask_jobqueue")
    s = job_script(_cfg(kind="pbs", **HPC), n_workers=4)
    lines = s.splitlines()
    assert "#PBS -q compute" in lines
    assert "#PBS -A proj42" in lines
    assert "#PBS -l walltime=02:30:00" in lines
    assert any(ln.startswith("#PBS -l select=1:ncpus=8:mem=") for ln in lines)
    assert "#PBS --exclusive" in lines
    assert "--nworkers 2" in s and "--nthreads 4" in s


def test_lsf_and_sge_scripts():
    pytest.importorskip("dask_jobqueue")
    lsf = job_script(_cfg(kind="lsf", **HPC), 2)
    assert "#BSUB -q compute" in lsf and '#BSUB -P "proj42"' in lsf and "#BSUB -n 8" in lsf
    sge = job_script(_cfg(kind="sge", **HPC), 2)
    assert "#$ -q compute" in sge and "#$ -l h_rt=02:30:00" in sge


def test_jobqueue_kwargs_and_errors():
    kw = jobqueue_kwargs(_cfg(kind="slurm", queue="q"), 4)
    assert kw["cores"] == 1 and kw["processes"] == 1 and kw["queue"] == "q"
    assert "account" not in kw
    with pytest.raises(IparError, match="each worker process needs"):
        jobqueue_kwargs(_cfg(kind="slurm", cores=1, processes=2), 4)
    with pytest.raises(IparError, match="job scripts exist only"):
        job_script(_cfg(kind="local"), 2)
    with pytest.raises(IparError, match="positive integer"):
        job_script(_cfg(kind="slurm"), 0)


def test_missing_jobqueue_says_how_to_install(monkeypatch):
    import builtins

    real = builtins.__import__

    def fake(name, *a, **k):
        if name.startswith("dask_jobqueue"):
            raise ImportError("no dask_jobqueue")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(IparError, match=r"pip install 'dask-ipar\[hpc\]'"):
        job_script(_cfg(kind="slurm"), 2)


def test_local_threads():
    assert local_threads(_cfg(cores=8), 2) == 4
    assert local_threads(_cfg(cores=3), 4) == 1
    assert local_threads(_cfg(), 1) >= 1


def test_local_cluster_sized_closed_and_joinable():
    logging.getLogger("distributed").setLevel(logging.ERROR)
    seen = []
    cfg = _cfg(cores=4, dashboard=False, wait_timeout=30.0)
    with make_cluster(cfg, 2, log=seen.append) as client:
        info = client.scheduler_info(n_workers=-1)
        workers = info["workers"]
        assert len(workers) == 2
        assert all(w["nthreads"] == 2 for w in workers.values())
        assert all(a.startswith("tcp://127.0.0.1:") for a in workers)
        assert client.run(lambda: __import__("os").environ.get("OMP_NUM_THREADS")) == {
            a: "2" for a in workers}
        # scheduler and workers run their event-loop housekeeping less often than dask's
        # defaults (QUIET_LOOP_CONFIG)
        import dask

        def loop_ms(dask_scheduler=None, dask_worker=None):
            pcs = (dask_scheduler or dask_worker).periodic_callbacks
            return pcs["tick"].callback_time, pcs["monitor"].callback_time

        assert client.run_on_scheduler(loop_ms) == (500, 2000)
        assert set(client.run(loop_ms).values()) == {(500, 2000)}
        # and the workers' statistical profiler samples every 100 ms (dask: 10 ms)
        assert set(client.run(lambda dask_worker: dask_worker.periodic_callbacks[
            "profile"].callback_time).values()) == {100}
        assert dask.config.get("distributed.admin.tick.interval") == "20ms"  # restored here
        # the scheduler's HTTP server (dashboard or health routes) listens on localhost only
        hosts = client.run_on_scheduler(
            lambda dask_scheduler: sorted({s.getsockname()[0] for s in
                                           dask_scheduler.http_server._sockets.values()}))
        assert hosts == ["127.0.0.1"]
        addr = client.scheduler.address
        # a second run joins this cluster by address, waits for its workers, leaves it up
        with make_cluster(_cfg(scheduler_address=addr, wait_timeout=10.0), 2) as c2:
            assert len(c2.scheduler_info(n_workers=-1)["workers"]) == 2
        assert len(client.scheduler_info(n_workers=-1)["workers"]) == 2
        with pytest.raises(IparError, match="needs 3"):
            with make_cluster(_cfg(scheduler_address=addr, wait_timeout=0.5), 3):
                pass
        cluster = client.cluster
    assert cluster.status.name == "closed"


def test_unreachable_scheduler():
    with pytest.raises(IparError, match="could not reach"):
        with make_cluster(_cfg(scheduler_address="tcp://127.0.0.1:1", connect_timeout=0.5), 1):
            pass


def test_job_script_exports_the_malloc_settings():
    pytest.importorskip("dask_jobqueue")
    s = job_script(_cfg(kind="slurm", **HPC), n_workers=2)
    assert "export MALLOC_MMAP_MAX_=0" in s and "export MALLOC_ARENA_MAX=1" in s
    assert "export DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL=500ms" in s
    assert "export DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__INTERVAL=2s" in s
    assert "export DASK_DISTRIBUTED__WORKER__PROFILE__INTERVAL=100ms" in s
    assert "export DASK_IPAR__MATMUL=auto" in s  # the workers multiply with the BLAS it picks
    assert "export DASK_IPAR__MATMUL=numpy" in job_script({**_cfg(kind="slurm", **HPC),
                                                           "matmul": "numpy"}, n_workers=2)
    assert "MALLOC_MMAP_MAX_" not in job_script(_cfg(kind="slurm", reuse_memory=False,
                                                     **HPC), n_workers=2)


def _malloc_use(nbytes):
    """On a worker: glibc's mallinfo2 while an ``nbytes`` array lives and after it is freed:
    (bytes in mappings of their own, bytes of heap) each time; None where not glibc."""
    import ctypes
    import platform

    import numpy as np

    if platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):  # glibc < 2.33
        return None

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc.mallinfo2.restype = Mallinfo2
    out = []
    for _ in range(2):  # the second time: the first one's memory, if it was kept
        a = np.ones(nbytes // 4, np.float32)
        live = libc.mallinfo2()
        del a
        freed = libc.mallinfo2()
        out.append(((live.hblkhd, live.arena), (freed.hblkhd, freed.arena)))
    return out


@pytest.mark.parametrize("reuse", [True, False])
def test_local_workers_keep_freed_memory(reuse):
    """glibc reads MALLOC_* at process start: the workers must have them from birth, and
    with them a 64 MiB array comes from the heap and its memory stays after it is freed."""
    import os

    from dask_ipar.runtime.worker_env import REUSE_MEMORY_ENV

    n = 64 * 2**20
    with make_cluster(_cfg(dashboard=False, reuse_memory=reuse), 1) as client:
        env = client.run(lambda: {k: os.environ.get(k) for k in REUSE_MEMORY_ENV})
        (use,) = client.run(_malloc_use, n).values()
    (got,) = env.values()
    if reuse:
        assert got == REUSE_MEMORY_ENV
    else:  # dask's own default
        assert got["MALLOC_MMAP_MAX_"] is None and got["MALLOC_TRIM_THRESHOLD_"] == "65536"
    if use is None:
        pytest.skip("not glibc >= 2.33: no mallinfo2 to look at")
    for (mapped, heap), (mapped_freed, heap_freed) in use:
        if reuse:  # carved from the heap, and the heap keeps it
            assert mapped < n and heap >= n and heap_freed >= n
        else:  # a mapping of its own, handed back when freed
            assert mapped >= n and mapped_freed < n and heap_freed < n


@pytest.mark.fast
def test_malloc_advice_only_where_the_adaptive_mmap_threshold_is_off():
    from dask_ipar.runtime.worker_env import REUSE_MEMORY_ENV, malloc_advice

    nanny = {"MALLOC_MMAP_THRESHOLD_": None, "MALLOC_TRIM_THRESHOLD_": "65536",
             "MALLOC_TOP_PAD_": None}
    unset = dict.fromkeys(REUSE_MEMORY_ENV)
    advice = malloc_advice({"w0": nanny, "w1": dict(REUSE_MEMORY_ENV), "w2": nanny})
    assert advice.startswith("2 of 3 workers run with MALLOC_TRIM_THRESHOLD_=65536")
    for k, v in REUSE_MEMORY_ENV.items():  # the fix, in the user's terms
        assert f"{k}={v}" in advice
    assert "docs/hpc.md" in advice
    # dask-ipar's settings, glibc's own adaptive defaults, no glibc: nothing to say
    assert malloc_advice({"w0": dict(REUSE_MEMORY_ENV), "w1": unset, "w2": None}) is None
    assert malloc_advice({}) is None


def test_workers_that_hand_memory_back_at_once_get_advice_once():
    """A cluster dask-ipar did not start (a nanny's defaults): the first grid bound on it
    logs the advice, later ones do not; dask-ipar's own clusters get none."""
    from distributed import Client, LocalCluster

    from dask_ipar.runtime.worker_env import check_malloc
    from dask_ipar.runtime.workers import bind_grid

    said = []
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        (w,) = client.scheduler_info()["workers"]
        with pytest.MonkeyPatch.context() as mp:  # bind_grid's advice goes to this log
            mp.setattr(logging.getLogger("dask_ipar"), "warning", said.append)
            bind_grid("1x1", client)
            bind_grid("1x1", client)
        assert len(said) == 1 and "1 of 1 workers run with MALLOC_TRIM_THRESHOLD_=65536" \
            in said[0]
        assert check_malloc(client, [w]) is None  # once per scheduler
    with make_cluster(_cfg(dashboard=False), 1) as client:
        (w,) = client.scheduler_info()["workers"]
        assert check_malloc(client, [w], log=said.append) is None
    assert len(said) == 1


def test_shutdown_heartbeat_errors_muted_and_nothing_else():
    """The filter dask-ipar installs on its workers before shutting a cluster down drops
    the heartbeat-race error record only."""
    import logging

    from dask_ipar.runtime.cluster import mute_shutdown_heartbeat_errors

    log = logging.getLogger("distributed.worker")
    before = list(log.filters)
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    h = Keep()
    log.addHandler(h)
    try:
        mute_shutdown_heartbeat_errors()
        log.error("Failed to communicate with scheduler during heartbeat.")
        log.error("Unexpected exception during heartbeat. Closing worker.")
        log.error("Compute Failed")
    finally:
        log.removeHandler(h)
        log.filters[:] = before
    assert seen == ["Unexpected exception during heartbeat. Closing worker.", "Compute Failed"]


def test_job_script_prologue_python_logs_and_blas_threads():
    """The batch settings a user adds reach the script, after dask-ipar's exports and
    dask-jobqueue's own (site) settings, which are kept."""
    import dask

    pytest.importorskip("dask_jobqueue")
    cfg = _cfg(kind="slurm", **HPC, job_script_prologue=["module load python/3.11"],
               python="/opt/venv/bin/python", log_directory="/scratch/logs")
    with dask.config.set({"jobqueue.slurm.job-script-prologue": ["source /site/env.sh"],
                          "jobqueue.slurm.job-extra-directives": ["--qos=site"]}):
        lines = job_script(cfg, n_workers=4).splitlines()
    # 8 cores, 2 processes: 4 BLAS threads per worker process (not dask's 1)
    assert {"export OMP_NUM_THREADS=4", "export OPENBLAS_NUM_THREADS=4",
            "export MKL_NUM_THREADS=4"} <= set(lines)
    order = [lines.index(x) for x in ("export OMP_NUM_THREADS=4", "source /site/env.sh",
                                      "module load python/3.11")]
    assert order == sorted(order), lines
    assert lines[-1].startswith("/opt/venv/bin/python -m distributed.cli.dask_worker")
    assert "#SBATCH -o /scratch/logs/dask-worker-%J.out" in lines
    assert "#SBATCH --qos=site" in lines and "#SBATCH --exclusive" in lines


def test_bad_batch_settings_in_the_config_are_named():
    from dask_ipar.config import ConfigError, validate

    with pytest.raises(ConfigError, match="cluster.job_script_prologue"):
        validate(_cfg(kind="slurm", job_script_prologue="module load x"))
    with pytest.raises(ConfigError, match="cluster.python"):
        validate(_cfg(kind="slurm", python=3))


def test_missing_submit_command_is_refused_before_anything_starts(monkeypatch):
    pytest.importorskip("dask_jobqueue")
    import shutil

    monkeypatch.setattr(shutil, "which", lambda cmd, *a, **k: None)
    with pytest.raises(IparError, match=r"--cluster pbs \(cluster.kind\) submits worker jobs "
                                        r"with qsub, which is not on this machine's PATH"):
        with make_cluster(_cfg(kind="pbs"), 2):
            pass


def test_rejection_messages_name_the_setting_to_change():
    from dask_ipar.runtime.batch import SubmitError, _stderr_of

    raw = RuntimeError("Command exited with non-zero exit code.\nExit code: 1\nCommand:\n"
                       "sbatch /tmp/x.sh\nstdout:\n\nstderr:\nsbatch: error: Memory "
                       "specification can not be satisfied\nsbatch: error: Batch job "
                       "submission failed: Requested node configuration is not available\n\n")
    msg = _stderr_of(raw, "sbatch")
    assert msg == ("Memory specification can not be satisfied; Batch job submission failed: "
                   "Requested node configuration is not available")
    line = SubmitError("slurm", "sbatch", msg).line()
    assert "\n" not in line and "cluster.memory" in line
    assert "cluster.queue" in SubmitError("pbs", "qsub", "Unknown queue").line()
    assert "cluster.account" in SubmitError("slurm", "sbatch", "Invalid account").line()


def test_hpc_docs_show_the_current_job_script():
    import importlib.util
    import pathlib

    pytest.importorskip("dask_jobqueue")
    path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "hpc_docs.py"
    spec = importlib.util.spec_from_file_location("hpc_docs", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = mod.DOC.read_text()
    assert mod.rewritten(text) == text, "docs/hpc.md is out of date: python scripts/hpc_docs.py"
    assert "export OMP_NUM_THREADS=4" in mod.block()  # 16 cores, 4 processes


def test_interrupted_client_call_noise_is_dropped_and_nothing_else():
    """dask 2026.8's sync() cancel callback raises NameError when Ctrl-C lands before its
    future exists; the CLI drops that one tornado record, not other NameErrors."""
    from dask_ipar.cli.args import _DropInterruptedSyncError

    def record(exc):
        return logging.LogRecord("tornado.application", logging.ERROR, "", 0,
                                 "Exception in callback", None,
                                 (type(exc), exc, exc.__traceback__))

    ns = {}
    exec(compile("def cancel():\n    if future is not None:\n        pass\n    future = 1\n",
                 "/env/site-packages/distributed/utils.py", "exec"), ns)
    keep = _DropInterruptedSyncError().filter
    with pytest.raises(NameError) as err:
        ns["cancel"]()
    assert not keep(record(err.value))
    with pytest.raises(NameError) as err:
        exec(compile("undefined_name", "/env/site-packages/distributed/other.py", "exec"))
    assert keep(record(err.value))
