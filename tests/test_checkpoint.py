"""Zarr checkpoints: layout, regrid round trips, atomic writes, corruption, worker faults."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")

from dask_ipar import SGD, Dense, Sequential  # noqa: E402
from dask_ipar.io import checkpoint as ck  # noqa: E402
from dask_ipar.io import checkpoint_save  # noqa: E402
from dask_ipar import reference as ref  # noqa: E402
from dask_ipar.errors import IparError  # noqa: E402

OPT = SGD(lr=0.1, momentum=0.9, weight_decay=1e-3)
ACTS = ["tanh", "linear"]


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(42)
    X = rng.standard_normal((48, 7))
    y = rng.integers(0, 5, 48)
    return X, y


def make_model(hidden=9, dtype="float64"):
    # awkward sizes: 9 rows over Pr=2 are 5+4, 7+1 columns over Pc=2 are 4+4, 5 over 4 is 2+1+1+1
    return Sequential([Dense(hidden, "tanh"), Dense(5)], input_dim=7, dtype=dtype, seed=3)


def run_steps(model, X, y, start, stop, batch=12, seed=0):
    for s in range(start, stop):
        idx = ck.batch_indices(len(X), batch, s, seed)
        model.client.gather(model.train_step(X[idx], y[idx], OPT))


def velocity(model):
    from distributed import wait

    sb = model.state_blocks()
    # momentum is rewritten in place by the update that makes the weights
    wait([f for lay in sb["layers"] for f in lay["w"].values()])
    out = []
    for lay in sb["layers"]:
        pr, pc = sb["grid"]
        blocks = model.client.gather(lay["v"])
        out.append(np.block([[blocks[(i, j)] for j in range(pc)] for i in range(pr)]))
    return out


def numpy_reference(params0, X, y, steps, batch=12, seed=0):
    params = [(W.copy(), b.copy()) for W, b in params0]
    vel = [None] * len(params)
    for s in range(steps):
        idx = ck.batch_indices(len(X), batch, s, seed)
        _, _, grads = ref.mlp_loss_and_grads(params, ACTS, X[idx].T, y[idx])
        params, vel = ref.sgd_step(params, vel, grads, OPT.lr, OPT.momentum, OPT.weight_decay)
    return params


def close(a, b, tol=1e-10):
    return all(np.abs(Wa - Wb).max() <= tol and np.abs(ba - bb).max() <= tol
               for (Wa, ba), (Wb, bb) in zip(a, b))


# --------------------------------------------------------------- pure parts
def test_owned_ranges_cover_each_axis_once():
    from dask_ipar.layout.partition import split_bounds

    for n in range(1, 30):
        for p in range(1, min(n, 6) + 1):
            bounds = split_bounds(n, p)
            chunk = max(b - a for a, b in bounds)
            covered = []
            for b0, b1 in bounds:
                r = checkpoint_save._owned_range(b0, b1, chunk, n)
                if r is not None:
                    assert r[0] % chunk == 0 and (r[1] % chunk == 0 or r[1] == n)
                    covered.extend(range(*r))
            assert covered == list(range(n))


def test_batch_indices_are_a_pure_function():
    a = [ck.batch_indices(50, 8, s, 1) for s in range(12)]
    b = [ck.batch_indices(50, 8, s, 1) for s in range(12)]
    assert all((x == z).all() for x, z in zip(a, b))
    assert sorted(np.concatenate(a[:6])) == sorted(set(np.concatenate(a[:6])))  # one epoch
    with pytest.raises(IparError):
        ck.batch_indices(5, 8, 0, 0)


# ------------------------------------------------------------- round trips
def test_layout_metadata_and_values(client4, data, tmp_path):
    X, y = data
    m = make_model().distribute(client4, "2x2")
    run_steps(m, X, y, 0, 2)
    path = ck.save(m, tmp_path, step=2, extra={"note": "x"})
    assert path == str(tmp_path / "ckpt-2") and ck.latest(tmp_path) == path
    assert (tmp_path / "LATEST").read_text().strip() == "ckpt-2"
    meta = ck.read_metadata(path)
    assert meta["format"] == ck.FORMAT and meta["step"] == 2 and meta["grid"] == [2, 2]
    assert meta["sizes"] == [7, 9, 5] and meta["has_velocity"] and meta["extra"] == {"note": "x"}
    assert [lay["activation"] for lay in meta["layers"]] == ACTS
    # read back with zarr alone: weights incl. bias column, momentum, chunks = blocks
    W = m.get_weights()
    V = velocity(m)
    for k, (Wk, bk) in enumerate(W):
        w = zarr.open_array(os.path.join(path, f"dense{k}", "w"), mode="r")
        assert w.dtype == np.float64
        np.testing.assert_array_equal(w[:], np.column_stack([Wk, bk]))
        np.testing.assert_array_equal(zarr.open_array(os.path.join(path, f"dense{k}", "v"))[:],
                                      V[k])
    assert zarr.open_array(os.path.join(path, "dense0", "w")).chunks == (5, 4)
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]


@pytest.mark.parametrize("grid", ["4x1", "1x1"])
def test_regrid_continues_like_an_uninterrupted_run(client4, data, tmp_path, grid):
    X, y = data
    full = make_model().distribute(client4, "2x2")
    params0 = full.get_weights()
    run_steps(full, X, y, 0, 3)
    ck.save(full, tmp_path, step=3)
    run_steps(full, X, y, 3, 6)
    expected = full.get_weights()
    full.close()

    other = make_model().distribute(client4, grid)
    assert ck.load(other, tmp_path)["step"] == 3
    run_steps(other, X, y, 3, 6)
    got = other.get_weights()
    assert close(got, expected)
    assert close(got, numpy_reference(params0, X, y, 6))  # independent NumPy reference
    # and back: saved on this grid, loaded on 2x2 (momentum too)
    ck.save(other, tmp_path, step=6)
    back = make_model().distribute(client4, "2x2")
    ck.load(back, tmp_path)
    assert close(back.get_weights(), got, 0.0)
    for a, b in zip(velocity(back), velocity(other)):
        np.testing.assert_array_equal(a, b)
    other.close()
    back.close()


def test_before_first_step_and_input_dim_from_checkpoint(client4, tmp_path):
    m = make_model().distribute(client4, "1x2")
    ck.save(m, tmp_path)  # step defaults to 0, no momentum yet
    assert not ck.read_metadata(ck.latest(tmp_path))["has_velocity"]
    m2 = Sequential([Dense(9, "tanh"), Dense(5)], dtype="float64", seed=99)
    m2.distribute(client4, "2x1")
    ck.load(m2, tmp_path)
    assert m2.input_dim == 7 and close(m2.get_weights(), m.get_weights(), 0.0)
    assert ck.save(m2, tmp_path).endswith("ckpt-1")  # next step number
    ck.save(m2, tmp_path, step=1)  # re-saving a step replaces it
    ck.save(m2, tmp_path, step=5, keep=2)
    assert [s for s, _ in ck.checkpoints(tmp_path)] == [1, 5]


# ------------------------------------------------------------- bad input
def test_corrupted_and_mismatched_checkpoints(client4, data, tmp_path):
    X, y = data
    m = make_model().distribute(client4, "2x2")
    run_steps(m, X, y, 0, 1)
    path = ck.save(m, tmp_path / "a", step=1)

    with pytest.raises(IparError, match="layer 0 has n_out=9 in the checkpoint but 8"):
        ck.load(make_model(hidden=8).distribute(client4, "2x2"), path)
    with pytest.raises(IparError, match="float64 weights but the model is float32"):
        ck.load(make_model(dtype="float32").distribute(client4, "2x2"), path)
    wrong_in = Sequential([Dense(9, "tanh"), Dense(5)], input_dim=6, dtype="float64")
    with pytest.raises(IparError, match="7 input features"):
        ck.load(wrong_in.distribute(client4, "2x2"), path)
    deeper = Sequential([Dense(9, "tanh"), Dense(9, "tanh"), Dense(5)], input_dim=7,
                        dtype="float64")
    with pytest.raises(IparError, match="3 here|holds a model of 2 layers"):
        ck.load(deeper.distribute(client4, "2x2"), path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(IparError, match="no complete checkpoint"):
        ck.load(m, tmp_path / "empty")

    fresh = make_model().distribute(client4, "4x1")
    before = fresh.get_weights()

    def broken(edit):
        import shutil

        p = str(tmp_path / f"b{len(os.listdir(tmp_path))}")
        shutil.copytree(path, p)
        edit(p)
        return p

    # a chunk file missing
    p = broken(lambda p: os.remove(os.path.join(p, "dense1", "w", "c", "0", "0")))
    with pytest.raises(IparError, match="chunk"):
        ck.load(fresh, p)
    # a chunk file damaged (the CRC32C checksum catches it on the reading worker)
    def flip(p):
        f = os.path.join(p, "dense0", "v", "c", "1", "1")
        b = bytearray(open(f, "rb").read())
        b[len(b) // 2] ^= 0xFF
        open(f, "wb").write(bytes(b))
    with pytest.raises(IparError, match="corrupted"):
        ck.load(fresh, broken(flip))
    # array of the wrong shape (metadata edited)
    def reshape(p):
        f = os.path.join(p, "dense1", "w", "zarr.json")
        meta = json.load(open(f))
        meta["shape"] = [5, 11]
        json.dump(meta, open(f, "w"))
    with pytest.raises(IparError, match=r"shape \(5, 11\), expected \(5, 10\)"):
        ck.load(fresh, broken(reshape))
    # a non-numeric (string / object) array is refused before any data is read
    def strings(p):
        import shutil

        shutil.rmtree(os.path.join(p, "dense1", "w"))
        a = zarr.create_array(os.path.join(p, "dense1", "w"), shape=(5, 10), dtype=str)
        a[:] = np.full((5, 10), "x")
    with pytest.raises(IparError, match="only float arrays are read"):
        ck.load(fresh, broken(strings))
    # garbage group metadata, another format
    with pytest.raises(IparError, match="corrupted"):
        ck.load(fresh, broken(lambda p: open(os.path.join(p, "zarr.json"), "w").write("{")))
    def other_format(p):  # another tool's group: no checksum of ours
        g = zarr.open_group(p, mode="r+")
        attrs = dict(g.attrs)
        attrs.pop("checksum")
        attrs["format"] = "something-else"
        g.attrs.put(attrs)
    with pytest.raises(IparError, match="not a dask-ipar checkpoint"):
        ck.load(fresh, broken(other_format))
    def edited_format(p):  # ours, damaged: the checksum says so
        zarr.open_group(p, mode="r+").attrs["format"] = "something-else"
    with pytest.raises(ck.CheckpointCorrupt, match="does not match its checksum"):
        ck.load(fresh, broken(edited_format))
    with pytest.raises(IparError, match="not a dask-ipar checkpoint|does not exist"):
        ck.read_metadata(tmp_path / "nothing")
    # the failed loads left the model as it was
    assert close(fresh.get_weights(), before, 0.0)
    m.close()
    fresh.close()


# -------------------------------------------------------------- crashes
CRASH_SCRIPT = textwrap.dedent("""
    import logging, os, sys
    import numpy as np
    from distributed import Client, LocalCluster
    from dask_ipar import Dense, Sequential, SGD
    from dask_ipar.io import checkpoint as ck
    if __name__ == "__main__":
        logging.getLogger("distributed").setLevel(logging.CRITICAL)
        directory, hook = sys.argv[1], sys.argv[2]
        cluster = LocalCluster(n_workers=2, processes=False, threads_per_worker=1,
                               dashboard_address=None)
        client = Client(cluster)
        rng = np.random.default_rng(0)
        X, y = rng.standard_normal((20, 7)), rng.integers(0, 5, 20)
        m = Sequential([Dense(9, "tanh"), Dense(5)], input_dim=7, dtype="float64", seed=3)
        m.distribute(client, "1x2").fit(X, y, batch_size=10, measure=False)
        ck.save(m, directory, step=1)
        W = m.get_weights()
        np.savez(os.path.join(directory, "..", "expected.npz"),
                 **{f"W{k}": w for k, (w, b) in enumerate(W)},
                 **{f"b{k}": b for k, (w, b) in enumerate(W)})
        m.fit(X, y, batch_size=10, measure=False)
        os.environ["DASK_IPAR_CHECKPOINT_WRITE_HOOK"] = hook  # touch, then hang mid-write
        ck.save(m, directory, step=2)
        print("not killed", flush=True)
""")


@pytest.mark.faults
def test_process_killed_during_checkpoint_write(client4, tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(CRASH_SCRIPT)
    directory, hook = tmp_path / "ck", tmp_path / "writing"
    proc = subprocess.Popen([sys.executable, str(script), str(directory), str(hook)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while not hook.exists():
            assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
            assert time.monotonic() < deadline, "the writer never reached the checkpoint write"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)  # mid-write: some chunks of ckpt-2 are on disk
    finally:
        proc.kill()
        proc.wait()
    leftovers = [p for p in os.listdir(directory) if ".tmp-" in p]
    assert leftovers and leftovers[0].startswith("ckpt-2.tmp-")
    assert ck.latest(directory) == str(directory / "ckpt-1")
    assert [s for s, _ in ck.checkpoints(directory)] == [1]
    m = make_model().distribute(client4, "2x2")
    assert ck.load(m, directory)["step"] == 1
    exp = np.load(tmp_path / "expected.npz")
    expected = [(exp[f"W{k}"], exp[f"b{k}"]) for k in range(2)]
    assert close(m.get_weights(), expected, 0.0)
    m.close()


@pytest.mark.faults
@pytest.mark.parametrize("grid,lineage",
                         [("2x2", 100), ("2x2", 1), ("1x4", 100)],
                         ids=["default", "cut-every-step", "1x4-uneven"])
def test_worker_killed_at_a_random_step_resumes_exactly(client4, data, tmp_path, grid, lineage):
    """With a lineage cut before every step the death is found during a cut. On 1x4 the
    weight columns split unevenly (uneven rows, whose checkpoint chunks straddle blocks:
    test_checkpoint_integrity's resume on 3x2); the result is bit-equal."""
    X, y = data
    steps, every = 6, 2
    plain = make_model().distribute(client4, grid)
    r = ck.train_with_checkpoints(plain, X, y, steps=steps, every=every, batch_size=12,
                                  optimizer=OPT, directory=tmp_path / "plain")
    assert r["restarts"] == 0 and r["steps"] == steps
    expected = plain.get_weights()
    expected_v = velocity(plain)
    plain.close()

    kill_at = int(np.random.default_rng().integers(1, steps))  # after this step completes
    model = make_model().distribute(client4, grid)
    model.lineage_steps = lineage
    victim = model.binding.worker(min(1, model.grid.pr - 1), model.grid.pc - 1)
    pid = client4.run(os.getpid, workers=[victim])[victim]
    lines, killed = [], []

    def on_step(step, loss):
        if step == kill_at and not killed:
            killed.append(step)
            os.kill(pid, signal.SIGKILL)

    r = ck.train_with_checkpoints(model, X, y, steps=steps, every=every, batch_size=12,
                                  optimizer=OPT, directory=tmp_path / "faulty",
                                  log=lines.append, on_step=on_step)
    msg = f"killed after step {kill_at}; log: {lines}"
    # one restart for the kill; under load the cluster's restart of the killed worker can
    # race the recovery's own (dask/distributed#7312), a second fault counted as such
    again = sum("left the cluster during recovery" in ln for ln in lines)
    assert killed and again <= 1 and r["restarts"] == 1 + again, msg
    assert any("left the cluster" in ln for ln in lines), msg
    assert any(ln.startswith("recovered on workers") for ln in lines), msg
    assert victim not in model.binding.workers, msg  # re-bound to the restarted worker
    assert close(model.get_weights(), expected, 0.0), msg
    for a, b in zip(velocity(model), expected_v):
        np.testing.assert_array_equal(a, b, err_msg=msg)
    assert len(r["losses"]) == steps
    model.close()
    # a fresh process resuming from the directory finds nothing left to do
    again = make_model().distribute(client4, "1x1")
    r2 = ck.train_with_checkpoints(again, X, y, steps=steps, every=every, batch_size=12,
                                   optimizer=OPT, directory=tmp_path / "faulty")
    assert r2["steps"] == steps and r2["losses"] == []
    assert close(again.get_weights(), expected)
    with pytest.raises(IparError, match="already holds checkpoints"):
        ck.train_with_checkpoints(again, X, y, steps=steps, every=every, batch_size=12,
                                  directory=tmp_path / "faulty", resume=False)
    again.close()


@pytest.mark.faults
def test_worker_killed_without_restarts_left_raises(client4, data, tmp_path):
    X, y = data
    model = make_model().distribute(client4, "2x2")
    victim = model.binding.worker(0, 1)
    pid = client4.run(os.getpid, workers=[victim])[victim]
    kill = lambda step, loss: step == 2 and os.kill(pid, signal.SIGKILL)  # noqa: E731
    with pytest.raises(ck.WorkerLost, match="left the cluster") as err:
        ck.train_with_checkpoints(model, X, y, steps=4, every=2, batch_size=12,
                                  optimizer=OPT, directory=tmp_path, max_restarts=0,
                                  on_step=kill)
    assert err.value.workers == [victim]
    assert ck.latest(tmp_path).endswith("ckpt-0")  # the step-2 save was never published
    model.close()
