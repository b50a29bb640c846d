"""Batch-system clusters through dask-jobqueue (SLURM, PBS, LSF, SGE).

* :func:`jobqueue_kwargs` and :func:`job_script`: what a worker job asks for and runs;
* :func:`start_batch_cluster`: the dask-jobqueue cluster (its scheduler runs in this
  process) with a job class of dask-ipar's that records failed submissions;
* :func:`check_submissions`: a rejected job (``sbatch: error: invalid partition ...``) as
  one :class:`~dask_ipar.errors.IparError` line, with the batch system's own message and
  the config key to change, raised while waiting for workers instead of a wait to the
  timeout; the asyncio and tornado log records of the same failure are dropped;
* :func:`replace_dead_jobs`: a worker job that ended (``scancel``, walltime, a node
  failure) is submitted again, so that a run's recovery has its workers back.

The job class subclasses dask-jobqueue's (``job_cls``, its public extension point) and
wraps ``Job.start``. Two private pieces of dask are used, here only:
``SpecCluster.worker_spec`` (the names the cluster should run, read to submit a dead job
again) and ``SpecCluster.workers`` (the jobs it runs, to drop a dead one).
"""

from __future__ import annotations

import logging
import math
import re
import shlex
import shutil
import signal
import threading
import time
import warnings

from dask_ipar.errors import IparError
from dask_ipar.runtime.worker_env import (
    QUIET_LOOP_CONFIG,
    SCHEDULER_CONFIG,
    REUSE_MEMORY_ENV,
    blas_environ,
    check_n,
    cluster_section,
    config_exports,
)

__all__ = ["JOBQUEUE_CLASSES", "SubmitError", "import_jobqueue", "jobqueue_kwargs",
           "job_script", "start_batch_cluster", "check_submissions", "replace_dead_jobs",
           "n_jobs", "forget", "waiting_jobs_note"]

#: dask-jobqueue cluster and job class names for each batch system.
JOBQUEUE_CLASSES = {
    "slurm": ("SLURMCluster", "dask_jobqueue.slurm", "SLURMJob"),
    "pbs": ("PBSCluster", "dask_jobqueue.pbs", "PBSJob"),
    "lsf": ("LSFCluster", "dask_jobqueue.lsf", "LSFJob"),
    "sge": ("SGECluster", "dask_jobqueue.sge", "SGEJob"),
}

_SYSTEM_NAMES = {"slurm": "SLURM", "pbs": "PBS", "lsf": "LSF", "sge": "SGE"}


def import_jobqueue():
    """``import dask_jobqueue``, or an IparError saying how to install it.

    Importing it installs a SIGINT handler (``dask_jobqueue/runner.py``) that calls
    ``sys.exit()``: Ctrl-C would end the command with status 0 and no checkpoint. The
    handler in place before the import is put back.
    """
    main = threading.current_thread() is threading.main_thread()
    saved = signal.getsignal(signal.SIGINT) if main else None
    try:
        import dask_jobqueue
    except ImportError:
        raise IparError(
            "batch-system clusters (slurm, pbs, lsf, sge) need dask-jobqueue, which is not "
            "installed. Install it with: pip install 'dask-ipar[hpc]' "
            "(or set cluster.kind: local)."
        ) from None
    finally:
        if main and saved is not None:
            signal.signal(signal.SIGINT, saved)
    return dask_jobqueue


def n_jobs(n_workers: int, processes: int) -> int:
    """Jobs of ``processes`` worker processes each that hold ``n_workers`` workers."""
    return math.ceil(n_workers / processes)


def _site_setting(kind: str, key: str) -> list:
    """A list setting of dask-jobqueue's own config for ``kind`` (``jobqueue.slurm.*``,
    from the site's or the user's ``~/.config/dask/jobqueue.yaml``), or []."""
    import dask

    value = dask.config.get(f"jobqueue.{kind}.{key}", None)
    return list(value or [])


def jobqueue_kwargs(cfg: dict, n_workers: int) -> dict:
    """Keyword arguments of the dask-jobqueue cluster/job class for ``cfg``.

    ``cores`` defaults to ``processes`` (one thread per worker process). Each worker
    process gets ``cores // processes`` threads and as many BLAS threads. The job
    script's prologue is dask-ipar's ``export`` lines (dask settings, malloc, BLAS), then
    dask-jobqueue's ``job-script-prologue`` setting, then ``cluster.job_script_prologue``
    (``module load ...``, ``source venv/bin/activate``), so the last two can override the
    first; job directives are dask-jobqueue's ``job-extra-directives``, then
    ``cluster.job_extra``.
    """
    check_n(n_workers)
    c = cluster_section(cfg)
    kind = c["kind"]
    processes = int(c["processes"])
    cores = c["cores"] if c["cores"] is not None else processes
    if cores < processes:
        raise IparError(
            f"cluster.cores is {cores} but cluster.processes is {processes}; each worker "
            f"process needs at least one core. Set cores >= {processes}."
        )
    site = kind in JOBQUEUE_CLASSES
    kw = {
        "cores": cores,
        "memory": c["memory"],
        "processes": processes,
        "walltime": c["walltime"],
        "job_extra_directives": (_site_setting(kind, "job-extra-directives") if site else [])
        + list(c.get("job_extra") or []),
    }
    # exported before the worker processes start; ipar.matmul: the workers' BLAS
    prologue = config_exports({**QUIET_LOOP_CONFIG, "ipar.matmul": cfg.get("matmul") or "auto"})
    if c.get("reuse_memory", True):
        prologue += [f"export {k}={v}" for k, v in REUSE_MEMORY_ENV.items()]
    # the nanny keeps BLAS variables that its own environment sets (else it sets them to 1)
    prologue += [f"export {k}={v}" for k, v in blas_environ(cores // processes).items()]
    if site:
        prologue += _site_setting(kind, "job-script-prologue")
    prologue += list(c.get("job_script_prologue") or [])
    kw["job_script_prologue"] = prologue
    for k in ("queue", "interface", "local_directory", "python", "log_directory"):
        if c.get(k) is not None:
            kw[k] = c[k]
    if c.get("account") is not None:
        # SLURM and PBS call it account; LSF and SGE call it project
        kw["account" if kind in ("slurm", "pbs") else "project"] = c["account"]
    return kw


def _classes(kind: str):
    if kind not in JOBQUEUE_CLASSES:
        raise IparError(
            f"cluster.kind is {kind!r}; job scripts exist only for "
            f"{', '.join(JOBQUEUE_CLASSES)}. Set cluster.kind to your batch system."
        )
    jq = import_jobqueue()
    import importlib

    cluster_name, module, job_name = JOBQUEUE_CLASSES[kind]
    return getattr(jq, cluster_name), getattr(importlib.import_module(module), job_name)


def job_script(cfg: dict, n_workers: int, scheduler_address: str = "tcp://scheduler:8786") -> str:
    """The batch script one job of a ``cluster.kind`` cluster would submit (nothing runs).

    Parameters
    ----------
    cfg : dict
        Configuration (``cluster`` section used).
    n_workers : int
        Workers the run needs (the grid's ``Pr*Pc``); jobs are ``ceil(n / processes)``.
    scheduler_address : str
        Written into the worker command line.
    """
    _, job_cls = _classes(cluster_section(cfg)["kind"])
    kw = jobqueue_kwargs(cfg, n_workers)
    kw.pop("interface", None)  # resolving an interface needs it to exist here
    return job_cls(scheduler=scheduler_address, name="dask-ipar-worker", **kw).job_script()


# ------------------------------------------------------------------ failed submissions
class SubmitError(RuntimeError):
    """The batch system refused a worker job (or its submit command is missing).

    Attributes
    ----------
    kind : str
        ``cluster.kind``.
    command : str
        The submit command (``sbatch``, ``qsub``, ``bsub``).
    message : str
        What the batch system said, on one line.
    """

    def __init__(self, kind: str, command: str, message: str):
        self.kind, self.command, self.message = kind, command, message
        super().__init__(self.line())

    def line(self) -> str:
        """The whole error on one line, with the config key to change."""
        return (f"{self.command} refused the worker job: {self.message}. "
                f"{_advice(self.kind, self.message)}")


def _advice(kind: str, message: str) -> str:
    """Which setting to change, judged from the batch system's message."""
    m = message.lower()
    where = "in the cluster section of the config (dask-ipar.yaml or --config FILE)"
    if "qos" in m or "policy" in m or "limit" in m:
        return (f"The request breaks a queue limit or QOS policy: lower cluster.walltime, "
                f"cluster.cores or cluster.memory {where}, or pick another cluster.queue "
                "(or a --qos=... line in cluster.job_extra)")
    if "invalid account" in m or "association" in m or "project" in m or "account" in m:
        return f"Set cluster.account {where} to a project you may charge"
    if "partition" in m or "queue" in m:
        listing = "sinfo" if kind == "slurm" else "qstat -Q" if kind == "pbs" else "bqueues"
        return (f"Set cluster.queue {where} to a queue that exists ({listing} lists them), "
                "or leave it unset for the default one")
    if "memory" in m or "mem" in m.split():
        return (f"Lower cluster.memory {where} (memory per job) to what a node has, or "
                "raise cluster.processes to share a job's memory among more workers")
    if "time limit" in m or "walltime" in m:
        return f"Lower cluster.walltime {where} to what the queue allows"
    if "cpu" in m or "core" in m or "processor" in m:
        return f"Lower cluster.cores {where} (cores per job) to what a node has"
    return ("Check the cluster section of the config (queue, account, memory, walltime, "
            "job_extra)")


def _stderr_of(exc: Exception, command: str) -> str:
    """The batch system's message in dask-jobqueue's RuntimeError, on one line (without
    the ``sbatch: error:`` prefixes)."""
    text = str(exc)
    m = re.search(r"stderr:\n(.*)", text, re.S)
    body = m.group(1) if m else text
    prefix = re.compile(rf"^{re.escape(command)}:\s*(error:\s*)?", re.I)
    lines = [prefix.sub("", ln.strip()) for ln in body.splitlines() if ln.strip()]
    if not lines and m:  # nothing on stderr: say what stdout said
        out = re.search(r"stdout:\n(.*?)\nstderr:", text, re.S)
        lines = [ln.strip() for ln in (out.group(1) if out else "").splitlines() if ln.strip()]
    return "; ".join(dict.fromkeys(lines)) or text.strip().replace("\n", " ")


class _DropSubmitErrors(logging.Filter):
    """Log filter: drops records that carry a :class:`SubmitError` (asyncio's "Task
    exception was never retrieved", tornado's "Exception in callback"); the error is
    raised to the user as one line instead."""

    def filter(self, record):
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, SubmitError)


_FILTER = _DropSubmitErrors()


def _mute_submit_tracebacks() -> None:
    for name in ("asyncio", "tornado.application", "distributed.deploy.spec",
                 "distributed.deploy.adaptive"):
        lg = logging.getLogger(name)
        if _FILTER not in lg.filters:
            lg.addFilter(_FILTER)


def _watched_job_class(job_cls, kind: str):
    """A subclass of ``job_cls`` whose failed submissions are kept in ``submit_errors``."""
    from distributed.core import Status

    command = shlex.split(job_cls.submit_command)[0]

    class Watched(job_cls):
        submit_errors: list  # set below: one list per cluster's job class

        async def start(self):
            try:
                await super().start()
            except Exception as exc:
                if self.job_id is not None:  # submitted: not a submission failure
                    raise
                err = SubmitError(kind, command, _stderr_of(exc, command))
                type(self).submit_errors.append(err)
                self.status = Status.failed  # what SpecCluster.close expects of a dead job
                raise err from None

    Watched.submit_errors = []
    Watched.__name__ = Watched.__qualname__ = job_cls.__name__
    Watched.__module__ = __name__
    return Watched


def start_batch_cluster(cfg: dict, n_workers: int, *, security=None, log=None):
    """The dask-jobqueue cluster of ``cfg``, with no job submitted yet.

    Raises
    ------
    IparError
        dask-jobqueue missing, the batch system's submit command not on PATH, or the
        cluster object could not be made (a bad interface, say).
    """
    import dask

    c = cluster_section(cfg)
    kind = c["kind"]
    cluster_cls, job_cls = _classes(kind)
    command = shlex.split(job_cls.submit_command)[0]
    if shutil.which(command) is None:
        raise IparError(
            f"--cluster {kind} (cluster.kind) submits worker jobs with {command}, which is "
            f"not on this machine's PATH: {_SYSTEM_NAMES[kind]} is not installed here or its "
            "commands "
            f"are not loaded. Run dask-ipar on a login node of the {_SYSTEM_NAMES[kind]} "
            f"cluster (or after `module load {kind}`), or choose the --cluster of your batch "
            "system (local for this machine)."
        )
    kw = jobqueue_kwargs(cfg, n_workers)
    # dask binds the dashboard to 127.0.0.1 (reachable through an ssh tunnel); a busy
    # 8787 falls back to a free port, which the printed link names
    sched = {"dashboard_address": "127.0.0.1:8787"} if c["dashboard"] else {"dashboard": False}
    if security is not None:
        kw["security"] = security
        kw["protocol"] = "tls://"
    _mute_submit_tracebacks()
    try:
        with dask.config.set({**QUIET_LOOP_CONFIG, **SCHEDULER_CONFIG}), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Port .* is already in use")
            # the scheduler runs in this process
            cluster = cluster_cls(scheduler_options=sched,
                                  job_cls=_watched_job_class(job_cls, kind), **kw)
    except Exception as exc:
        raise IparError(
            f"could not start the {kind} cluster ({type(exc).__name__}: {exc}). Check the "
            "cluster section of the config (queue, account, interface)."
        ) from exc
    if log is not None:
        log(f"submitting {n_jobs(n_workers, kw['processes'])} {kind} job(s) for "
            f"{n_workers} workers ({kw['processes']} per job)")
    return cluster


def check_submissions(cluster) -> None:
    """Raise the first failed submission of ``cluster``'s jobs as one-line IparError."""
    errors = getattr(getattr(cluster, "job_cls", None), "submit_errors", None)
    if errors:
        raise IparError(errors[0].line())


#: The command that shows why a job has not started, per batch system.
_STATUS_COMMANDS = {"slurm": "squeue -j", "pbs": "qstat -f", "lsf": "bjobs -l", "sge": "qstat -j"}


def waiting_jobs_note(cluster, connected_names) -> str:
    """What the batch system says of the jobs whose workers have not connected, for the
    error at the end of a wait: ``; 2 worker jobs (14, 15) have not started: squeue -j
    14,15 shows why (SLURM: Resources)``. Empty for a cluster that is not a batch one."""
    kind = next((k for k, (name, _, _) in JOBQUEUE_CLASSES.items()
                 if type(cluster).__name__ == name), None)
    if kind is None:
        return ""
    spec = getattr(cluster, "worker_spec", {}) or {}
    ids = []
    for name, job in _queued_jobs(cluster).items():
        workers = _worker_names(spec, name)
        if not any(w in connected_names for w in workers):
            ids.append(str(job.job_id))
    if not ids:
        return ""
    note = (f"; {len(ids)} worker job(s) ({', '.join(ids)}) have not started their workers: "
            f"{_STATUS_COMMANDS[kind]} {','.join(ids)} shows why")
    if kind == "slurm" and shutil.which("squeue"):
        import subprocess

        try:
            out = subprocess.run(["squeue", "-h", "-o", "%r", "-j", ",".join(ids)],
                                 capture_output=True, text=True, timeout=5).stdout
            reasons = sorted({r.strip() for r in out.splitlines()
                              if r.strip() and r.strip() != "None"})
            if reasons:
                note += f" (SLURM's reason: {', '.join(reasons)})"
        except (OSError, subprocess.SubprocessError):
            pass
    return note


def _worker_names(spec: dict, name) -> list[str]:
    """The worker names of job ``name``: the job's own, or with a suffix per process
    (``SLURMCluster-0-0``, ``SLURMCluster-0-1``) when the job runs several."""
    group = spec.get(name, {}).get("group")
    return [f"{name}{g}" for g in group] if group else [str(name)]


def _queued_jobs(cluster) -> dict:
    """The cluster's jobs by name: dask-jobqueue Job objects with their ``job_id``."""
    return {name: job for name, job in dict(getattr(cluster, "workers", {})).items()
            if getattr(job, "job_id", None) is not None}


def replace_dead_jobs(cluster, connected_names, *, grace_s: float = 10.0, log=None) -> list:
    """Submit again the jobs of ``cluster`` whose workers left the scheduler.

    dask-jobqueue keeps the job object of a worker whose job ended (``scancel``, the
    walltime, a node failure) and submits no new one; dask's own clean-up
    (``distributed.deploy.lost-worker-timeout``) is keyed by worker name and misses jobs
    of several processes. Call this as the scheduler's workers are polled, with
    ``connected_names`` the worker names it has now: a job whose workers were all
    connected once and have all been gone for ``grace_s`` seconds (at once where SLURM
    says the job has ended) is cancelled (in case it still runs) and dropped, and the
    cluster is scaled back to its spec, which submits a fresh job under the same name.
    Returns the names of the jobs replaced.
    """
    from distributed.core import Status

    spec = getattr(cluster, "worker_spec", None)
    if not isinstance(spec, dict):
        return []
    now = time.monotonic()
    state = _JOB_STATE.setdefault(id(cluster), {"jobs": {}, "known": set(), "told": set()})
    jobs, known, told = state["jobs"], state["known"], state["told"]
    replaced = []
    gone = []  # (name, job, key): all workers missing, after having connected
    for name, job in _queued_jobs(cluster).items():
        known.add(name)
        workers = _worker_names(spec, name)
        key = (name, job.job_id)
        if any(w in connected_names for w in workers):
            jobs[key] = None  # connected: not missing
            continue
        if key not in jobs:  # not connected yet: still queued or starting
            continue
        if jobs[key] is None:
            jobs[key] = now  # missing since now
        gone.append((name, job, key))
    ended = set()
    if gone and now - state.get("asked", 0.0) >= 2.0:  # squeue at most every 2 s
        state["asked"] = now
        ended = _ended_jobs(cluster, [str(job.job_id) for _, job, _ in gone])
    for name, job, key in gone:
        if now - jobs[key] > grace_s or str(job.job_id) in ended:
            replaced.append(name)
            del jobs[key]
            cluster.workers.pop(name, None)
            cluster.sync(job.close)
            job.status = Status.closed  # dask-jobqueue's Job.close leaves it running
    # jobs dropped here or by dask's own clean-up (lost-worker-timeout)
    missing = [name for name in spec if name not in cluster.workers and name in known]
    if missing:
        new = [str(m) for m in missing if m not in told]
        if log is not None and new:
            log(f"worker job(s) {', '.join(new)} ended: submitting replacement(s)")
        told.update(missing)
        # in jobs: scale(n) counts workers, ceil(n / processes) jobs
        cluster.scale(jobs=len(spec))  # starts a job for each name of the spec not running
    else:
        told.clear()
    return replaced


#: SLURM job states after which a job runs no more.
_SLURM_ENDED = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "COMPLETING", "DEADLINE", "FAILED",
                "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT"}


def _ended_jobs(cluster, job_ids: list) -> set:
    """The ids among ``job_ids`` that SLURM says have ended (listed in an end state, or no
    more), so that they are replaced without waiting out the grace period; one ``squeue``
    call. Other batch systems: none (the grace period decides)."""
    if type(cluster).__name__ != JOBQUEUE_CLASSES["slurm"][0] or not shutil.which("squeue"):
        return set()
    import subprocess

    try:
        proc = subprocess.run(["squeue", "-h", "-o", "%i %T", "-j", ",".join(job_ids)],
                              capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return set()
    if proc.returncode != 0:  # "Invalid job id specified": all purged from the queue
        return set(job_ids) if "invalid job id" in proc.stderr.lower() else set()
    states = dict(ln.split(None, 1) for ln in proc.stdout.splitlines() if len(ln.split()) == 2)
    return {i for i in job_ids if i not in states or states[i] in _SLURM_ENDED}


def forget(cluster) -> None:
    """Drop what :func:`replace_dead_jobs` kept of ``cluster`` (at its close)."""
    _JOB_STATE.pop(id(cluster), None)


#: Per cluster (by id): "jobs": (job name, job id) -> None while its workers are
#: connected, else when they were first seen all gone; "known": job names that were
#: submitted; "told": names whose replacement was reported.
_JOB_STATE: dict = {}
