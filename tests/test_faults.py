"""Fault injection: grid workers that stop answering (SIGSTOP) while a model trains.

A stopped worker holds its TCP connections open and never fails a task, so dask waits for
it (its worker TTL, 5 minutes by default); dask-ipar notices the missing heartbeats
(``dask-ipar.hung-after``, 30 s), has the worker's nanny restart it, and recovers from the
last checkpoint, or stops with one line naming the worker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import dask
import numpy as np
import pytest

zarr = pytest.importorskip("zarr")

from dask_ipar import SGD, Dense, Sequential  # noqa: E402
from dask_ipar.errors import IparError  # noqa: E402
from dask_ipar.io import checkpoint as ck  # noqa: E402
from dask_ipar.runtime.loop import Callback  # noqa: E402

pytestmark = pytest.mark.faults
OPT = SGD(lr=0.1, momentum=0.9)


def make_model():
    return Sequential([Dense(9, "tanh"), Dense(5)], input_dim=7, dtype="float64", seed=3)


def same_weights(model, expected, msg=""):
    """The model's weights equal ``expected`` bit for bit."""
    for (w, b), (we, be) in zip(model.get_weights(), expected):
        np.testing.assert_array_equal(w, we, err_msg=msg)
        np.testing.assert_array_equal(b, be, err_msg=msg)


def uninterrupted(client, X, y, grid="2x2", **kw) -> list:
    """The weights after a run without faults (``fit`` settings as :func:`_fit`)."""
    model = make_model().distribute(client, grid)
    _fit(model, X, y, **kw)
    out = model.get_weights()
    model.close()
    return out


def whole_again(client, n: int = 4) -> None:
    """Wait until the killed workers are back, as the library's recovery does: a nanny whose
    restart failed (dask/distributed#7312, seen on a loaded CI machine) is started anew.
    Then the same ``n`` workers for 3 s: on CI a fourth worker was listed, then gone before
    the next test bound its grid (sessions 39 and 40), and stayed gone."""
    from dask_ipar.runtime.workers import scheduler_workers, wait_for_workers

    deadline = time.monotonic() + 120
    while True:
        wait_for_workers(client, n, 90, revive=True)
        seen = set(scheduler_workers(client))
        if seen == _SETTLED.get(id(client)):  # the workers last seen settled: no wait
            return
        time.sleep(3)
        if set(scheduler_workers(client)) == seen or time.monotonic() > deadline:
            _SETTLED[id(client)] = seen
            return


_SETTLED: dict = {}  # per client: the workers whole_again last saw settled


@pytest.fixture(autouse=True)
def _whole_first(request):
    """Every test on the shared 4-worker cluster starts on four settled workers."""
    if "client4" in request.fixturenames:
        whole_again(request.getfixturevalue("client4"))


def pids_of(client, workers) -> list:
    """Process ids of ``workers``, in their order."""
    got = client.run(os.getpid, workers=list(workers))
    return [got[w] for w in workers]


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(42)
    return rng.standard_normal((48, 7)), rng.integers(0, 5, 48)


class StopAt(Callback):
    """SIGSTOP ``pid`` when step ``at`` has ended (the next step then waits for it)."""

    def __init__(self, pid, at):
        self.pid, self.at, self.when = pid, at, None

    def on_step_end(self, loop, stats):
        if stats.step == self.at and self.when is None:
            self.when = time.monotonic()
            os.kill(self.pid, signal.SIGSTOP)


def _resume(pid):
    """Let a stopped process go on (and die, if its nanny killed it meanwhile)."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def test_stopped_worker_ends_the_run_with_one_line(client4, data):
    """No checkpoints: the stopped worker is named within ``dask-ipar.hung-after`` plus a
    liveness check (here 4 s and 1 s; by default 30 s and 5 s, the issue's bound being
    60 s: the default is asserted in test_a_bad_hung_after_setting_is_refused), and it is
    restarted."""
    X, y = data
    model = make_model().distribute(client4, "2x2")
    victim = model.binding.worker(1, 0)
    [pid] = pids_of(client4, [victim])
    model.liveness_check_s = 1.0  # the grid checked every second (5 s by default)
    stop = StopAt(pid, 2)
    try:
        with dask.config.set({"dask-ipar.hung-after": "4s"}), \
                pytest.raises(IparError, match="stopped answering") as err:
            model.fit(X, y, epochs=3, batch_size=12, optimizer=OPT, callbacks=[stop],
                      progress=False)
        detected = time.monotonic() - stop.when
    finally:
        _resume(pid)
        model.close()
    msg = str(err.value)
    assert victim in msg and "grid cell (1, 0)" in msg and "\n" not in msg, msg
    print(f"stopped worker named after {detected:.1f} s")
    assert 3 < detected < 20, detected  # hung-after + a liveness check, on a busy machine
    from dask_ipar.runtime.workers import scheduler_workers

    assert victim not in scheduler_workers(client4)  # its nanny restarted it
    whole_again(client4)


def test_a_finished_result_on_a_stopped_worker_does_not_hold_the_gather(client4):
    """A step's results done before their worker stopped answering: fetching them names
    the stopped worker (a plain ``client.gather`` waits forever on its open connection;
    seen when a stop fell between a pipelined step's end and its losses' gather)."""
    model = make_model().distribute(client4, "2x2")
    victim = model.binding.worker(0, 1)
    [pid] = pids_of(client4, [victim])
    fut = client4.submit(np.ones, 3, workers=[victim], pure=False)
    fut.result()
    model.liveness_check_s = 1.0
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with dask.config.set({"dask-ipar.hung-after": "2s"}), \
                pytest.raises(IparError, match="stopped answering"):
            model._store.gather_step([fut], 7)
        assert time.monotonic() - t0 < 30
    finally:
        _resume(pid)
        del fut
        model.close()
    whole_again(client4)


def test_weights_on_a_stopped_worker_do_not_hold_get_weights(client4, data):
    """``get_weights`` after training, its blocks done before a grid worker stopped
    answering: the fetch names the stopped worker within the liveness checks (a plain
    ``client.gather`` waits forever on the stopped worker's open connection)."""
    X, y = data
    model = make_model().distribute(client4, "2x2")
    model.fit(X, y, epochs=1, batch_size=12, optimizer=OPT, progress=False)
    model.get_weights()  # every block done (and the fetch works)
    victim = model.binding.worker(1, 0)
    [pid] = pids_of(client4, [victim])
    model.liveness_check_s = 1.0
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with dask.config.set({"dask-ipar.hung-after": "4s"}), \
                pytest.raises(IparError, match="stopped answering while its blocks were "
                                               "fetched") as err:
            model.get_weights()
        assert victim in err.value.workers, err.value
        assert time.monotonic() - t0 < 30
    finally:
        _resume(pid)
        model.close()
    whole_again(client4)


def test_stopped_worker_is_restarted_and_the_run_recovers_exactly(client4, data, tmp_path):
    """With checkpoints the run recovers on the restarted worker and ends bit-equal to an
    uninterrupted run (float64)."""
    X, y = data
    steps, every = 6, 2
    plain = make_model().distribute(client4, "2x2")
    r = ck.train_with_checkpoints(plain, X, y, steps=steps, every=every, batch_size=12,
                                  optimizer=OPT, directory=tmp_path / "plain")
    expected = plain.get_weights()
    plain.close()

    model = make_model().distribute(client4, "2x2")
    victim = model.binding.worker(0, 1)
    [pid] = pids_of(client4, [victim])
    model.liveness_check_s = 1.0
    lines, stopped = [], []

    def on_step(step, loss):
        if step == 3 and not stopped:
            stopped.append(time.monotonic())
            os.kill(pid, signal.SIGSTOP)

    try:
        with dask.config.set({"dask-ipar.hung-after": "4s"}):
            r = ck.train_with_checkpoints(model, X, y, steps=steps, every=every,
                                          batch_size=12, optimizer=OPT,
                                          directory=tmp_path / "faulty", log=lines.append,
                                          on_step=on_step)
    finally:
        _resume(pid)
    msg = f"log: {lines}"
    assert stopped and r["restarts"] >= 1, msg
    assert any("stopped answering" in ln and victim in ln for ln in lines), msg
    assert any(ln.startswith("recovered on workers") for ln in lines), msg
    assert victim not in model.binding.workers, msg
    same_weights(model, expected, msg)
    model.close()


@pytest.mark.fast
def test_a_bad_hung_after_setting_is_refused():
    from dask_ipar.runtime.workers import hung_after_s

    assert hung_after_s() == 30.0
    with dask.config.set({"dask-ipar.hung-after": "2 minutes"}):
        assert hung_after_s() == 120.0
    for bad in ("soon", 0, "-5s"):
        with dask.config.set({"dask-ipar.hung-after": bad}), \
                pytest.raises(IparError, match="dask-ipar.hung-after"):
            hung_after_s()


@contextlib.contextmanager
def external_cluster(*worker_args_each):
    """``dask scheduler`` and one ``dask worker`` process per argument list (quiet, no
    dashboards); yields the scheduler's address; every process is killed at the end."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host",
                               "127.0.0.1", "--port", str(port), "--no-dashboard"], **quiet)]
    procs += [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address,
                                "--nthreads", "1", "--no-dashboard", *args], **quiet)
              for args in worker_args_each]
    try:
        yield address
    finally:  # no graceful close needed (a worker without a nanny can take long)
        for p in procs[::-1]:
            p.kill()
        for p in procs:
            p.wait(30)


def test_a_hung_worker_whose_nanny_is_stopped_too_is_removed_within_the_timeout():
    """A suspended batch job stops the nanny with its worker: the nanny is asked to kill
    its worker for at most ``timeout_s`` (it never answers), then the worker is taken off
    the scheduler, so a recovery does not wait on it (an unbounded ask hung here)."""
    from distributed import Client

    from dask_ipar.runtime.workers import release_hung_workers, scheduler_workers

    with external_cluster(["--nworkers", "1"], ["--nworkers", "1"]) as address, \
            Client(address, timeout=30) as client:  # a nanny process each
        client.wait_for_workers(2, timeout=60)
        victim, other = sorted(scheduler_workers(client))
        pid = client.run(os.getpid, workers=[victim])[victim]
        nanny = client.run(os.getpid, workers=[victim], nanny=True)[victim]
        assert nanny not in (pid, os.getpid())  # its own process (a LocalCluster's is ours)
        for p in (nanny, pid):
            os.kill(p, signal.SIGSTOP)
        out = []
        release = threading.Thread(target=lambda: out.append(
            release_hung_workers(client, [victim], timeout_s=2.0)), daemon=True)
        t0 = time.monotonic()
        try:
            release.start()
            release.join(30)  # a release that hangs fails here, not by hanging the tests
            took = time.monotonic() - t0
            listed = set(scheduler_workers(client))
        finally:
            for p in (nanny, pid):
                _resume(p)
        release.join(30)
    assert took < 15 and out, f"the release took {took:.0f} s"
    assert out == [[]] and victim not in listed and other in listed, (out, listed)


# ------------------------------------------------------------------ replicas
class KillAt(Callback):
    """Send ``sig`` (SIGKILL) to each of ``pids`` when step ``at`` has ended (before the
    next refresh)."""

    def __init__(self, pids, at, sig=signal.SIGKILL):
        self.pids, self.at, self.sig, self.done = list(pids), at, sig, False

    def on_step_end(self, loop, stats):
        if stats.step == self.at and not self.done:
            self.done = True
            for pid in self.pids:
                os.kill(pid, self.sig)


def _fit(model, X, y, **kw):
    kw.setdefault("optimizer", OPT)
    return model.fit(X, y, epochs=3, batch_size=12, progress=False, **kw)


@pytest.mark.parametrize("grid,seed,opt", [("2x2", 1, "sgd"), ("4x1", 2, "sgd"),
                                           ("1x4", 3, "sgd"), ("2x2", 4, "adamw"),
                                           ("4x1", 5, "adamw")])
def test_killed_worker_is_rebuilt_from_replicas_exactly(client4, data, grid, seed, opt):
    """No checkpoint: a grid worker SIGKILLed at a random step is rebuilt from its buddy's
    replica on the worker its nanny restarts, and the run ends bit-equal (float64); the
    replicas' bytes are measured equal to the cost model's. With AdamW the replica carries
    both moments and the restored update count (bias correction), and the rebuilt cell's
    fused in-place update makes the same bits as the uninterrupted run's."""
    from dask_ipar import AdamW
    from dask_ipar.runtime.replicas import Replicas

    X, y = data
    optimizer, slots = (OPT, 1) if opt == "sgd" else (AdamW(lr=0.05, weight_decay=0.01), 2)
    plain = make_model().distribute(client4, grid)
    h = _fit(plain, X, y, replicas=1, optimizer=optimizer)
    expected = plain.get_weights()
    plain.close()
    rows = {(r.layer, r.phase): r for r in h.comm.rows}
    rep = rows[("state", "replica")]
    assert rep.predicted_bytes > 0 and rep.measured_bytes == rep.predicted_bytes
    # the planner prices the same bytes: 12 refreshes, the first before any momentum
    from dask_ipar.cost import FC, Machine, evaluate_grid
    from dask_ipar.cost.replica import network_state_words

    pr, pc = map(int, grid.split("x"))
    net = [FC(7, 9), FC(9, 5)]
    planned = evaluate_grid(net, pr, pc, 12, Machine(word_bytes=8), replicas=1,
                            opt_slots=slots)
    per_refresh = next(p for p in planned.phases if p.phase == "replica").total_bytes
    first = sum(network_state_words(net, pr, pc, 0).values()) * 8
    assert rep.measured_bytes * h.comm.steps == first + 11 * per_refresh
    assert planned.replica_comm_s > 0

    at = int(np.random.default_rng(seed).integers(2, 11))
    model = make_model().distribute(client4, grid)
    victim = model.binding.worker(grid.startswith("4") and 2 or 0, grid.startswith("1") and 3 or 0)
    [pid] = pids_of(client4, [victim])
    lines = []
    h = _fit(model, X, y, replicas=Replicas(1, log=lines.append), callbacks=[KillAt([pid], at)],
             optimizer=optimizer)
    msg = f"killed after step {at}: {lines}"
    assert any(ln.startswith("recovered from the replicas of step") for ln in lines), msg
    assert victim not in model.binding.workers and len(h.steps) == 12, msg
    same_weights(model, expected, msg)
    model.close()
    whole_again(client4)


@pytest.mark.parametrize("cell", [(1, 1), (0, 1)], ids=["row1", "row0-holds-losses"])
def test_killed_worker_with_several_steps_per_program_recovers_exactly(client4, data, cell):
    """Four steps per submission (the epochs here), replicas every four steps: a worker
    SIGKILLed while a submission runs is rebuilt, its submission run again, and the run
    ends bit-equal to one step at a time without a fault; also when the worker is one of
    grid row 0, which hold the submission's loss statistics."""
    from dask_ipar.runtime.replicas import Replicas

    X, y = data
    plain = make_model().distribute(client4, "2x2")
    _fit(plain, X, y, replicas=4)
    expected = plain.get_weights()
    plain.close()
    model = make_model().distribute(client4, "2x2")
    [pid] = pids_of(client4, [model.binding.worker(*cell)])
    lines = []
    h = _fit(model, X, y, replicas=Replicas(4, log=lines.append), steps_per_program=4,
             callbacks=[KillAt([pid], 5)])  # once the submission of steps 5-8 came back
    # the refresh of step 8 meets the dead worker: back to the one of step 4
    assert any(ln.startswith("recovered from the replicas of step 4") for ln in lines), lines
    assert len(h.steps) == 12, lines
    same_weights(model, expected, str(lines))
    model.close()
    whole_again(client4)


def test_two_workers_lost_at_once(client4, data):
    """Two grid workers killed together: rebuilt when each one's buddy survived; a cell
    lost with its buddy (cell (0, 0)'s replica lives on cell (1, 0)) cannot be, and
    without a checkpoint the error names the cells."""
    from dask_ipar.io.checkpoint import WorkerLost

    X, y = data
    expected = uninterrupted(client4, X, y, replicas=1)
    model = make_model().distribute(client4, "2x2")
    row = [model.binding.worker(0, 0), model.binding.worker(0, 1)]  # buddies: row 1
    pids = pids_of(client4, row)
    lines = []
    from dask_ipar.runtime.replicas import Replicas

    _fit(model, X, y, replicas=Replicas(1, log=lines.append), callbacks=[KillAt(pids, 5)])
    assert any(ln.startswith("recovered from the replicas") for ln in lines), lines
    same_weights(model, expected)
    model.close()
    whole_again(client4)

    model = make_model().distribute(client4, "2x2")
    pair = [model.binding.worker(0, 0), model.binding.worker(1, 0)]
    pids = pids_of(client4, pair)
    with pytest.raises(WorkerLost, match=r"replicas of grid cell\(s\) \(0, 0\), \(1, 0\)"):
        _fit(model, X, y, replicas=1, callbacks=[KillAt(pids, 4)])
    model.close()
    whole_again(client4)


def test_cli_on_an_external_cluster_survives_a_killed_worker(tmp_path, capsys):
    """The issue's acceptance: ``dask scheduler`` + ``dask worker --nworkers 5``,
    ``dask-ipar train --grid 2x2 --dtype float64`` with no checkpoint directory and a grid
    worker SIGKILLed mid-run: exit 0 and the final test loss of an uninterrupted run."""
    import json
    import threading

    from distributed import Client

    from dask_ipar.cli.main import main

    with external_cluster(["--nworkers", "5"]) as address, \
            Client(address, timeout=30) as watch:
        args = ["train", "--scheduler-address", address, "--grid", "2x2", "--dtype",
                "float64", "--epochs", "4", "--replicas", "5", "--no-progress", "--json",
                "--no-dashboard"]
        watch.wait_for_workers(5, timeout=60)
        assert main(args) == 0
        plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        killed = []

        def kill_mid_run():  # once the run has made a few refreshes
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                done = watch.run_on_scheduler(lambda dask_scheduler: sum(
                    1 for k in dask_scheduler.tasks if "state.rep-" in str(k)))
                if done >= 8:
                    break
                time.sleep(0.05)
            # pid and name in one call (two calls raced a worker list that changed
            # between them: a KeyError in this thread, no kill)
            info = watch.run(lambda dask_worker: (os.getpid(), dask_worker.name))
            victim = sorted(info, key=lambda w: str(info[w][1]))[1]
            killed.append(victim)
            os.kill(info[victim][0], signal.SIGKILL)

        t = threading.Thread(target=kill_mid_run)
        t.start()
        rc = main(args)
        t.join()
        cap = capsys.readouterr()
    assert rc == 0, cap.err[-3000:]
    assert killed and "recovered from the replicas of step" in cap.err, cap.err[-3000:]
    got = json.loads(cap.out.strip().splitlines()[-1])
    assert got["test_loss"] == plain["test_loss"], (got, plain)
    assert got["test_accuracy"] == plain["test_accuracy"]


@pytest.mark.parametrize("grid", ["4x1"])  # model parallel: the lost cell holds weight rows
def test_api_on_an_external_cluster_survives_a_killed_worker(data, grid):
    """The acceptance through the Python API: ``dask scheduler`` + ``dask worker
    --nworkers 5``, no checkpoint directory, a grid worker SIGKILLed mid-run: its nanny
    restarts it, the replicas rebuild its blocks there, and the run ends bit-equal."""
    from distributed import Client

    from dask_ipar.runtime.replicas import Replicas

    X, y = data
    with external_cluster(["--nworkers", "5"]) as address, \
            Client(address, timeout=30) as client:
        client.wait_for_workers(5, timeout=60)
        expected = uninterrupted(client, X, y, grid, replicas=1)
        model = make_model().distribute(client, grid)
        victim = model.binding.worker(2 if grid == "4x1" else 0, 0 if grid == "4x1" else 2)
        [pid] = pids_of(client, [victim])
        lines = []
        h = _fit(model, X, y, replicas=Replicas(1, log=lines.append),
                 callbacks=[KillAt([pid], 6)])
        assert any(ln.startswith("recovered from the replicas of step") for ln in lines), lines
        assert victim not in model.binding.workers and len(h.steps) == 12, lines
        same_weights(model, expected, str(lines))
        model.close()


def test_the_client_hears_at_once_that_a_grid_worker_died(client4):
    """The scheduler's remove-worker event of a SIGKILLed worker reaches the client's
    Departures (what wakes a step's wait at once); the other worker is not reported."""
    from dask_ipar.runtime.departures import departures

    victim, other = sorted(client4.scheduler_info()["workers"])[:2]
    heard = departures(client4)
    heard.watch([victim, other])
    assert heard.gone([victim, other]) == []
    [pid] = pids_of(client4, [victim])
    os.kill(pid, signal.SIGKILL)
    try:
        deadline = time.monotonic() + 30
        while not heard.gone([victim, other]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert heard.gone([victim, other]) == [victim], "no remove-worker event within 30 s"
        assert departures(client4) is heard  # one per client: dask keeps one handler a topic
    finally:
        whole_again(client4)


def test_stopped_worker_is_rebuilt_from_replicas(client4, data):
    """A hung worker (SIGSTOP) with replicas and no checkpoint: restarted, rebuilt from its
    buddy's copy, the run bit-equal to an uninterrupted one."""
    from dask_ipar.runtime.replicas import Replicas

    X, y = data
    expected = uninterrupted(client4, X, y, replicas=2)

    model = make_model().distribute(client4, "2x2")
    victim = model.binding.worker(1, 1)
    [pid] = pids_of(client4, [victim])
    model.liveness_check_s = 1.0
    lines = []
    try:
        with dask.config.set({"dask-ipar.hung-after": "4s"}):
            _fit(model, X, y, replicas=Replicas(2, log=lines.append),
                 callbacks=[StopAt(pid, 5)])
    finally:
        _resume(pid)
    assert any(ln.startswith("recovered from the replicas") for ln in lines), lines
    assert victim not in model.binding.workers
    same_weights(model, expected)
    model.close()
    whole_again(client4)


def test_no_replacement_worker_regrids_onto_the_survivors(data):
    """Workers without nannies (``dask worker --no-nanny``): a killed one never comes back,
    so after the wait the run goes on on the largest grid the three survivors hold (1x3)
    from the replicas, and ends bit-equal to an uninterrupted run that moved to 1x3 at the
    same step."""
    from distributed import Client

    from dask_ipar.runtime.replicas import Replicas

    X, y = data

    class RegridAt(Callback):
        def wants_sync(self, loop, step):
            return step == 3

        def on_sync(self, loop, step):
            loop.model.distribute(loop.model.client, "1x3")

    workers = [["--no-nanny", "--name", f"w{k}"] for k in range(4)]
    with external_cluster(*workers) as address:
        client = Client(address, timeout=30)
        client.wait_for_workers(4, timeout=60)
        expected = uninterrupted(client, X, y, callbacks=[RegridAt()], measure=False)

        model = make_model().distribute(client, "2x2")
        victim = model.binding.worker(1, 0)
        [pid] = pids_of(client, [victim])
        lines = []
        rep = Replicas(3, wait_timeout_s=2.0, log=lines.append)
        h = _fit(model, X, y, replicas=rep, callbacks=[KillAt([pid], 4)])
        assert any("going on on grid 1x3" in ln for ln in lines), lines
        assert any("recovered from the replicas of step 3" in ln for ln in lines), lines
        assert (model.grid.pr, model.grid.pc) == (1, 3) and len(h.steps) == 12
        same_weights(model, expected)
        rows = {(r.layer, r.phase): r for r in h.comm.rows}
        assert rows[("state", "replica")].measured_bytes > 0
        model.close()
        client.close()


# ------------------------------------------------------------------ preemption
def TermAt(pids, at):
    """SIGTERM each of ``pids`` when step ``at`` has ended (a batch system ending a job)."""
    return KillAt(pids, at, signal.SIGTERM)


def test_sigterm_to_a_worker_job_saves_its_step_and_the_run_goes_on(data, tmp_path):
    """SIGTERM to a ``dask worker`` process and its worker (what SLURM sends every process
    of a job before its walltime ends): the run saves the step it is on before the worker
    goes, recovers from that step on the spare worker (no step runs twice) and ends
    bit-equal to an uninterrupted run. With replicas and no checkpoint directory, the
    replicas are refreshed at that step instead."""
    from distributed import Client

    from dask_ipar.runtime.replicas import Replicas

    X, y = data
    with external_cluster(*[["--nworkers", "1"]] * 6) as address, \
            Client(address, timeout=30) as client:  # a spare worker for each run
        client.wait_for_workers(6, timeout=60)
        expected = uninterrupted(client, X, y)
        for kind in ("checkpoint", "replicas"):
            model = make_model().distribute(client, "2x2")
            victim = model.binding.worker(1, 0)
            [pid] = pids_of(client, [victim])
            nanny = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            lines = []
            if kind == "checkpoint":
                kw = dict(checkpoint=ck.Checkpointing(tmp_path / "ck", log=lines.append))
            else:
                kw = dict(replicas=Replicas(10, log=lines.append))
            h = _fit(model, X, y, callbacks=[TermAt([nanny, pid], 5)], **kw)
            msg = f"{kind}: {lines}"
            left = [ln for ln in lines if "leaving" in ln]
            assert len(left) == 1 and victim in left[0], msg
            at = int(left[0].split(":")[0].split()[1])
            if kind == "checkpoint":
                assert left[0].endswith(f"their state is in {tmp_path / 'ck'}/ckpt-{at}"), msg
                assert any(f"resuming after step {at} from" in ln for ln in lines), msg
            else:
                assert any(ln.startswith(f"recovered from the replicas of step {at} ")
                           for ln in lines), msg
            assert victim not in model.binding.workers and len(h.steps) == 12, msg
            same_weights(model, expected, msg)
            model.close()
            # the worker's `dask worker` process ended: nothing restarts it
            assert len(client.scheduler_info(n_workers=-1)["workers"]) == 5 - (kind == "replicas")


def test_sigterm_with_preempt_stop_saves_and_ends_the_run(client4, data, tmp_path):
    """``dask-ipar.preempt: stop``: a worker's SIGTERM ends the run after a checkpoint of
    the step it was on, as a SIGTERM to the training process does."""
    from dask_ipar.runtime.loop import Interrupted

    X, y = data
    model = make_model().distribute(client4, "2x2")
    [pid] = pids_of(client4, [model.binding.worker(0, 1)])
    with dask.config.set({"dask-ipar.preempt": "stop"}), pytest.raises(Interrupted) as e:
        _fit(model, X, y, checkpoint=ck.Checkpointing(tmp_path / "ck"),
             callbacks=[TermAt([pid], 3)])
    assert e.value.signum == signal.SIGTERM and e.value.saved, e.value
    assert "got SIGTERM" in str(e.value)
    assert ck.latest(tmp_path / "ck").endswith(f"ckpt-{e.value.step}"), e.value
    assert e.value.step >= 3
    model.close()
    whole_again(client4)


def test_bad_preempt_settings_are_refused():
    from dask_ipar.runtime.preempt import preempt_grace_s, preempt_mode

    assert preempt_grace_s() == 20.0 and preempt_mode() == "recover"
    with dask.config.set({"dask-ipar.preempt-grace": "soon"}), \
            pytest.raises(IparError, match="dask-ipar.preempt-grace"):
        preempt_grace_s()
    with dask.config.set({"dask-ipar.preempt": "pause"}), \
            pytest.raises(IparError, match="recover, stop"):
        preempt_mode()
