"""The /ipar dashboard page and the run card's timeline: pure parts against hand-made
records, the live page in headless Chromium during a run (both executors), an external
scheduler, and the run card of a CNN."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
import numpy as np
import pytest

from dask_ipar import Conv2d, Dense, Flatten, MaxPool2d, Sequential
from dask_ipar.dashboard.stream import splice, stream_groups
from dask_ipar.dashboard.svg import nice_ticks
from dask_ipar.dashboard.timeline import bars_of, phase_summary, step_timelines
from dask_ipar.runtime.loop import Callback
from dask_ipar.testing import wait_for_program_bars
from dask.utils import key_split
from distributed import get_task_stream
from distributed.diagnostics.task_stream import TaskStreamPlugin, rectangles
from htmltables import Tables

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _table(html_text, table_id="phase-table"):
    p = Tables()
    p.feed(html_text)
    return p.tables.get(table_id, []), p.ids


def _num(s):
    return float(s) if s else 0.0


def check_phase_table(html_text, layers, compute=("forward", "backward", "update"),
                      ids=("grid", "timeline", "chart-loss", "chart-accuracy",
                           "chart-throughput")):
    """Every layer appears with its compute phases measured (> 0 ms) and every collective
    the model predicts bytes for measured at the same bytes; one row is critical."""
    rows, found = _table(html_text)
    assert rows and rows[0][:4] == ["layer", "phase", "predicted bytes", "measured bytes"]
    body = {(r[0], r[1].replace("◀ critical", "").strip()): r for r in rows[1:]}
    for layer in layers:
        for phase in compute:
            assert _num(body[(layer, phase)][6]) > 0, (layer, phase, body.get((layer, phase)))
    collectives = [r for r in body.values() if r[2] and _num(r[2]) > 0]
    assert collectives, "no collective with predicted bytes"
    for r in collectives:
        assert _num(r[3]) == pytest.approx(_num(r[2])), r  # measured bytes = predicted
        assert _num(r[5]) > 0, r  # and measured seconds
    assert sum("critical" in r[1] for r in rows[1:]) == 1
    assert set(ids) <= found
    return body


def _dump_dom(url, tmp_path, shot=None):
    args = [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1400,2400"]
    if shot is not None:
        subprocess.run(args + [f"--screenshot={shot}", url], capture_output=True, timeout=120,
                       check=True)
    return subprocess.run(args + ["--dump-dom", url], capture_output=True, text=True,
                          timeout=120, check=True).stdout


def _digits(n=600, d=24, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d)).astype(np.float32)
    return X, (X[:, :classes].argmax(1)).astype(np.int64)


# ------------------------------------------------------------------ pure parts
@pytest.mark.fast
def test_timeline_bars_phases_and_the_critical_cell():
    cells = {"a": (0, 0), "b": (1, 0)}
    t = 100.0
    recs = {
        "a": [("dense0.act-u1-s5", "compute", t, t + 0.010, None),
              ("dense0.act-u1-s5", "send", t + 0.010, t + 0.012, "b"),
              ("dense0.bwd-u1-s5", "compute", t + 0.012, t + 0.015, None),
              ("dense0.dz-u1-s5", "compute", t + 0.02, t + 0.021, None),
              ("dense0.w-u1-s5", "compute", t + 0.021, t + 0.022, None),
              ("dense0.dz-u1-s6", "compute", t + 1, t + 1.001, None),
              ("dense0.dz-other-s5", "compute", t, t + 5, None)],  # another model's
        "b": [("dense0.act-u1-s5", "wait", t + 0.001, t + 0.012, "a"),
              ("dense0.dwp-u1-s5", "recv", t + 0.013, t + 0.030, "a"),
              ("dense0.dz-u1-s5", "compute", t + 0.030, t + 0.040, None)],
        "c": [("dense0.act-u1-s5", "compute", t, t + 9, None)],  # not a grid worker
    }
    per = bars_of(recs, cells, uid="u1")
    assert sorted(per) == [5, 6]
    five = per[5]
    # dask's fetch is drawn on both lanes: received by b, sent by a
    assert {(b.cell, b.kind) for b in five if b.phase == "dw_reduce"} == {((1, 0), "recv"),
                                                                          ((0, 0), "send")}
    wait = next(b for b in five if b.kind == "wait")
    assert (wait.layer, wait.phase, wait.peer) == ("dense0", "fwd_gather", (0, 0))
    tls = step_timelines(recs, cells, "u1")  # step 6 is the newest: not complete yet
    assert [tl.step for tl in tls] == [5]
    tl = tls[0]
    assert tl.critical_cell() == (1, 0) and tl.seconds == pytest.approx(0.040)
    rows, critical = phase_summary(tls)
    by = {(r["layer"], r["phase"]): r for r in rows}
    assert by[("dense0", "forward")]["compute_s"] == pytest.approx(0.010)
    assert by[("dense0", "fwd_gather")]["wait_s"] == pytest.approx(0.011)
    # the largest over cells: a's 3 + 1 ms against b's 10 ms
    assert by[("dense0", "backward")]["compute_s"] == pytest.approx(0.010)
    assert by[("dense0", "update")]["compute_s"] == pytest.approx(0.001)
    # on the critical cell (1, 0) the 11 ms wait outweighs the 10 ms backward
    assert (critical["layer"], critical["phase"]) == ("dense0", "fwd_gather")
    assert critical["critical_s"] == pytest.approx(0.011)
    assert [tl.step for tl in step_timelines(recs, cells, "u1", complete_only=False)] == [5, 6]


@pytest.mark.fast
def test_program_bars_replace_the_program_in_the_task_stream():
    """A program's kernels and waits, grouped by layer and phase, take its place in
    dask's task stream; the stream's running index still counts every entry."""
    trace = [["dense0.act-u1-s4", "compute", 10.0, 10.1],  # as a program records them
             ["dense0.dwp-u1-s4", "wait", 10.1, 10.3],
             ["dense0.act-u1-s4", "compute", 10.3001, 10.4],  # merges with the first
             ["dense0.dz-u1-s4", "compute", 10.4, 10.5]]
    groups = stream_groups(trace)
    assert [(k, a, len(s)) for k, a, s in groups] == [
        ("dense0.forward-u1-s4", "compute", 2), ("dense0.dw_reduce-u1-s4-wait", "transfer", 1),
        ("dense0.backward-u1-s4", "compute", 1)]
    assert groups[0][2] == [[10.0, 10.1], [10.3001, 10.4]]  # the wait splits them

    class Sched:
        plugins: dict = {}

    ts = TaskStreamPlugin(Sched(), maxlen=100)
    prog = ("step.run0-u1-s4", 2)
    for key in [("other", 0), prog]:
        ts.transition(key, "processing", "memory", worker="tcp://a", thread=7, status="OK",
                      startstops=[{"action": "compute", "start": 10.0, "stop": 10.5}])
    assert splice(ts, prog, groups, delay=0.25)
    assert ts.index == len(ts.buffer) == 4
    rect = rectangles(list(ts.buffer))
    assert sorted(set(rect["name"])) == ["dense0.backward", "dense0.forward", "other",
                                         "transfer-dense0.dw_reduce"]
    assert set(rect["worker_thread"]) == {"tcp://a-7"}  # the program's lane
    assert min(rect["start"][1:]) == pytest.approx(1e3 * 10.30)  # mid-bar, shifted by 0.25
    assert not splice(ts, prog, groups)  # replaced already


@pytest.mark.fast
def test_nice_ticks_cover_the_range():
    for lo, hi in [(0, 1), (0.13, 0.97), (3, 1234), (-2.5, 7.1), (5, 5)]:
        t = nice_ticks(lo, hi)
        assert 2 <= len(t) <= 12 and t == sorted(t)
        assert t[0] <= lo + 1e-9 or t[0] - lo < (t[1] - t[0])


@pytest.mark.fast
def test_times_in_tables_keep_microseconds():
    """A 72-byte transfer over a direct link takes microseconds: the tables show it as
    measured (two significant digits), not as 0.00 ms; zero stays zero."""
    from dask_ipar.dashboard.render import fmt_ms

    assert fmt_ms(0.0) == "0.00"
    assert fmt_ms(4.2e-6) == "0.0042" and float(fmt_ms(3.3e-8)) == pytest.approx(3.3e-5)
    assert fmt_ms(1.234e-3) == "1.23" and fmt_ms(0.5) == "500.00"


# ------------------------------------------------------------------ live page
def _page_base(client):
    port = client.scheduler_info()["services"]["dashboard"]
    return f"http://127.0.0.1:{port}/ipar"


@pytest.mark.parametrize("executor", ["programs", "graph"])
def test_page_shows_every_layer_and_phase_while_training(client, executor, tmp_path):
    if executor == "programs" and CHROMIUM is None:
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    """The page, opened in headless Chromium while a 2x2 MLP trains, shows every layer's
    compute phases with measured milliseconds and every collective with its bytes measured
    equal to the prediction; the grid, the timeline and the curves are there."""
    X, y = _digits(600)
    model = Sequential([Dense(32, "relu"), Dense(16, "relu"), Dense(4)], input_dim=24)
    model.distribute(client, "2x2")
    model.executor = executor
    out = {}

    class Watch(Callback):  # the run goes on until the page has been read
        def on_step_end(self, loop, stats):
            out["step"] = stats.step
            if out.get("read"):
                loop.stop("the page was read")

    fit = threading.Thread(target=lambda: out.setdefault("h", model.fit(
        X, y, epochs=60, batch_size=40, callbacks=[Watch()])))
    fit.start()
    try:
        deadline = time.monotonic() + 120
        while out.get("step", 0) < 20:  # the comm table comes at each epoch's end (15 steps)
            assert fit.is_alive() and time.monotonic() < deadline
            time.sleep(0.1)
        if executor == "programs":  # rendered by Chromium; the same HTML as served
            dom = _dump_dom(_page_base(client), tmp_path)
        else:
            dom = urllib.request.urlopen(_page_base(client)).read().decode()
    finally:
        out["read"] = True
        fit.join()
        model.close()
    assert out["h"].stopped and len(out["h"].epochs) < 60  # read mid-run
    assert "training" in _table(dom, "run")[0][0][1]  # read mid-run
    check_phase_table(dom, ["dense0", "dense1", "dense2"])
    assert dom.count('class="bar"') > 20  # kernels drawn in the timeline
    cells = _table(dom, "grid")[0]
    assert len(cells) == 3 and all("memory" in c for r in cells[1:] for c in r[1:])
    data = json.loads(urllib.request.urlopen(_page_base(client) + "/data.json").read())
    assert data["run"]["executor"] == executor and data["timeline"]
    # the page has it all; dask's event broker keeps no second copy (scheduler memory)
    from dask_ipar.dashboard.page import TOPIC
    from dask_ipar.dashboard.stream import STREAM_TOPIC

    assert client.get_events(TOPIC) == () and client.get_events(STREAM_TOPIC) == ()


def test_task_stream_names_each_program_layer_and_phase(client):
    """With worker programs, dask's own task stream (``get_task_stream``, what the
    dashboard's /status page and ``performance_report`` draw) shows each layer's forward,
    backward and update and each collective's waits, not one bar per program."""
    X, y = _digits(320)
    model = Sequential([Dense(32, "relu"), Dense(16, "relu"), Dense(4)], input_dim=24)
    model.distribute(client, "2x2")
    try:
        start = time.time()
        with get_task_stream(client) as ts:
            model.fit(X, y, epochs=2, batch_size=40)
            wait_for_program_bars(client, start=start)
    finally:
        model.close()
    names = {("transfer-" if ss["action"] == "transfer" else "") + key_split(e["key"])
             for e in ts.data for ss in e["startstops"]}
    assert not [n for n in names if n.startswith("step.run")], names
    for layer in ("dense0", "dense1", "dense2"):
        assert {f"{layer}.forward", f"{layer}.backward", f"{layer}.update"} <= names
    waits = {n for n in names if n.startswith("transfer-dense")}
    assert {"transfer-dense1.fwd_gather", "transfer-dense2.dx_reduce"} <= waits, names
    lanes = {(e["worker"], e["thread"]) for e in ts.data
             if key_split(e["key"]) == "dense1.forward"}
    assert len({w for w, _ in lanes}) == 4  # every grid cell's worker


def test_page_on_an_external_scheduler(tmp_path, capsys):
    """A scheduler started by ``dask scheduler`` (its dashboard on) gets the page from
    the client that trains on it; the CLI (run in this process) prints its address."""
    import socket

    from dask_ipar.cli.main import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    sched = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host",
                              "127.0.0.1", "--port", str(port), "--dashboard-address",
                              "127.0.0.1:0"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    workers = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address,
                                "--nworkers", "2", "--nthreads", "1", "--no-dashboard"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        rc = main(["train", "--scheduler-address", address, "--grid", "2x1", "--epochs", "2",
                   "--no-progress", "--executor", "graph"])
        err = capsys.readouterr().err
        assert rc == 0, err[-3000:]
        page = next(ln.split()[-1] for ln in err.splitlines()
                    if ln.startswith("dask-ipar: training page "))
        assert page.startswith("http://127.0.0.1:") and page.endswith("/ipar")
        html_text = urllib.request.urlopen(page).read().decode()
        check_phase_table(html_text, ["dense0", "dense1", "dense2"])
        assert "finished" in html_text and "test accuracy" in html_text
    finally:
        for p in (workers, sched):
            p.terminate()
        for p in (workers, sched):
            p.wait(timeout=30)


# ------------------------------------------------------------------ run card
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_run_card_of_a_cnn_shows_the_timeline(client, tmp_path):
    """The run card of a 2x2 strip CNN: the timeline's per-layer table with every conv,
    pooling and dense layer measured, curves with axes and the validation curve,
    rendered by headless Chromium at 1,400 px."""
    from dask_ipar.dashboard.recorder import collect_records
    from dask_ipar.io.report import write_run_card

    rng = np.random.default_rng(1)
    X = rng.standard_normal((160, 1, 8, 8)).astype(np.float32)
    y = (X[:, 0, :4, :4].sum((1, 2)) > 0).astype(np.int64)
    model = Sequential([Conv2d(4, 3, activation="relu"), MaxPool2d(2), Flatten(),
                        Dense(8, "relu"), Dense(2)], input_shape=(1, 8, 8))
    model.distribute(client, "2x2")
    hist = model.fit(X, y, epochs=2, batch_size=32, validation_data=(X[:32], y[:32]))
    records = collect_records(client, model.binding.workers, model.uid)
    path = tmp_path / "card.html"
    write_run_card(path, {"grid": "2x2", "test_accuracy": 0.5, "test_loss": 0.7}, hist, model,
                   records=records)
    model.close()
    dom = _dump_dom(path.as_uri(), tmp_path, tmp_path / "card.png")
    body = check_phase_table(dom, ["dense3", "dense4"],
                             ids=("cells", "timeline", "chart-loss", "chart-accuracy"))
    assert _num(body[("conv0", "forward")][6]) > 0 and ("conv0", "halo_fwd") in body
    assert "validation loss" in dom and "test accuracy" in dom and "<iframe" not in dom
    assert (tmp_path / "card.png").stat().st_size > 50_000


@pytest.mark.fast
def test_long_runs_keep_a_bounded_thinned_curve():
    """The scheduler keeps at most STEPS_KEPT points of a run's curve: the older half
    thinned, the newest steps whole (its memory stays flat over any number of steps)."""
    from dask_ipar.dashboard.page import STEPS_KEPT, IparDashboard

    page = IparDashboard()
    page.log_event("dask-ipar", {"kind": "run", "uid": "u", "model_uid": "m", "grid": "1x2",
                                 "cells": [], "started": 1.0})
    for start in range(1, 50_001, 100):
        page.log_event("dask-ipar", {"kind": "steps", "uid": "u", "steps": [
            [s, 0.5, 0.5, 0.01] for s in range(start, start + 100)]})
    steps = [s[0] for s in page.runs["u"].steps]
    assert len(steps) <= STEPS_KEPT + 100 and steps == sorted(steps)
    assert steps[0] == 1 and steps[-1] == 50_000
    assert steps[-STEPS_KEPT // 2:] == list(range(50_001 - STEPS_KEPT // 2, 50_001))
