"""Screenshots of the /ipar dashboard page and of the run card, for docs/dashboard.md.

Trains a 2x2 MLP and a 2x2 strip CNN on the bundled digits on a LocalCluster of four
worker processes, opens ``<dashboard>/ipar`` in headless Chromium while each one trains,
writes each run card, and screenshots both at 1,400 px width into ``docs/img/``:
``dashboard-mlp.png``, ``dashboard-cnn.png``, ``runcard-mlp.png``, ``runcard-cnn.png``;
and dask's own task stream of the 2x2 MLP's worker programs (the Task Stream tab of a
``performance_report``), ``task-stream-programs.png``.

    python scripts/dashboard_shots.py          # needs Debian's chromium and dask-ipar[train]
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "img"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars"]


def shot(chromium, url, png, height, profile):
    subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile}",
                    f"--window-size=1400,{height}", f"--screenshot={png}", url],
                   capture_output=True, timeout=120, check=True)
    print(f"wrote {png.relative_to(ROOT)}")


def train_and_shoot(client, chromium, name, model, X, y, Xv, yv, tmp, page_h, card_h):
    from dask_ipar.dashboard.recorder import collect_records
    from dask_ipar.io.report import write_run_card
    from dask_ipar.runtime.loop import Callback

    state = {}

    class Watch(Callback):  # trains until the page has been shot (at an epoch's end)
        def on_step_end(self, loop, stats):
            state["step"] = stats.step
            if state.get("shot"):
                loop.stop("the screenshot was taken")

    model.distribute(client, "2x2")
    t = threading.Thread(target=lambda: state.setdefault("hist", model.fit(
        X, y, epochs=200, batch_size=64, validation_data=(Xv, yv), standardize=True,
        callbacks=[Watch()])))
    t.start()
    steps_per_epoch = len(X) // 64
    while state.get("step", 0) < 2 * steps_per_epoch + 5 and t.is_alive():
        time.sleep(0.2)
    port = client.scheduler_info()["services"]["dashboard"]
    try:
        shot(chromium, f"http://127.0.0.1:{port}/ipar", OUT / f"dashboard-{name}.png", page_h,
             tmp / "profile")
    finally:
        state["shot"] = True
        t.join()
    hist = state["hist"]
    res = model.evaluate(Xv, yv)
    card = tmp / f"{name}.html"
    write_run_card(card, {"model": repr(model), "grid": "2x2", "test_loss": res["loss"],
                          "test_accuracy": res["accuracy"]}, hist, model,
                   records=collect_records(client, model.binding.workers, model.uid))
    model.close()
    shot(chromium, card.as_uri(), OUT / f"runcard-{name}.png", card_h, tmp / "profile")


def task_stream_shot(client, chromium, model, X, y, tmp):
    """Dask's task stream of one epoch of worker programs: a bar per layer and phase."""
    import re

    from distributed import performance_report

    model.distribute(client, "2x2")
    report = tmp / "perf.html"
    with performance_report(filename=str(report), mode="inline"):
        model.fit(X, y, epochs=1, batch_size=64)
        time.sleep(0.5)  # the last programs' bars
    model.close()
    page = report.read_text()  # open the report on its "Task Stream" tab
    page, n = re.subn(r'("name":"Tabs","id":"p\d+","attributes":\{)', r'\1"active":1,', page,
                      count=1)
    assert n == 1, "the performance report's layout changed: no Tabs"
    report.write_text(page)
    shot(chromium, report.as_uri(), OUT / "task-stream-programs.png", 700, tmp / "profile")


def main() -> int:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("needs Debian's chromium (apt-get install chromium)", file=sys.stderr)
        return 2
    import numpy as np
    from distributed import Client, LocalCluster

    from dask_ipar import Conv2d, Dense, Flatten, MaxPool2d, Sequential
    from dask_ipar.io.data import load_digits_split

    Xtr, ytr, Xte, yte = load_digits_split()
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d, \
            LocalCluster(n_workers=4, threads_per_worker=1, host="127.0.0.1",
                         dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        tmp = Path(d)
        mlp = Sequential([Dense(128, "relu"), Dense(64, "relu"), Dense(10)], input_dim=64)
        train_and_shoot(client, chromium, "mlp", mlp, Xtr, ytr, Xte, yte, tmp, 1900, 2900)
        mlp = Sequential([Dense(128, "relu"), Dense(64, "relu"), Dense(10)], input_dim=64)
        task_stream_shot(client, chromium, mlp, Xtr[:640], ytr[:640], tmp)
        img = lambda X: np.asarray(X, np.float32).reshape(-1, 1, 8, 8)  # noqa: E731
        cnn = Sequential([Conv2d(8, 3, activation="relu"), MaxPool2d(2), Flatten(),
                          Dense(64, "relu"), Dense(10)], input_shape=(1, 8, 8))
        train_and_shoot(client, chromium, "cnn", cnn, img(Xtr), ytr, img(Xte), yte, tmp,
                        2200, 3300)
    return 0


if __name__ == "__main__":
    sys.exit(main())
