"""Checkpoints that are always right: uneven grids, resume from any checkpoint, checksums,
edited metadata, fall-back, closed models, storage faults."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")

from dask_ipar import SGD, Dense, Sequential  # noqa: E402
from dask_ipar.io import checkpoint as ck  # noqa: E402
from dask_ipar.io import checkpoint_save, checkpoint_tasks  # noqa: E402
from dask_ipar.io.checkpoint_format import CheckpointCorrupt, CheckpointStorageError  # noqa: E402
from dask_ipar.errors import IparError  # noqa: E402

OPT = SGD(lr=0.1, momentum=0.9, weight_decay=1e-3)
# Blocks that do not divide the widths, so chunks straddle blocks on every grid below
# (checked by `straddles`): 10 rows over Pr=4 are 3+3+2+2 (chunk 3), over Pr=3 4+3+3
# (chunk 4); 8 inputs + bias over Pc=4 are 3+2+2+2 (chunk 3), 10 + bias over Pc=5
# 3+2+2+2+2.
UNEVEN = ["4x1", "1x4", "3x2", "1x5"]


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(7)
    return rng.standard_normal((40, 8)), rng.integers(0, 5, 40)


def make_model(seed=3):
    return Sequential([Dense(10, "tanh"), Dense(5)], input_dim=8, dtype="float64", seed=seed)


def state(model):
    """Weights (bias as last column) and momentum of every layer, gathered from the owners."""
    from distributed import wait

    sb = model.state_blocks()
    wait([f for lay in sb["layers"] for f in lay["w"].values()])
    pr, pc = sb["grid"]
    out = {}
    for lay in sb["layers"]:
        for kind in ("w", "v"):
            if lay[kind] is None:
                continue
            blocks = model.client.gather(lay[kind])
            out[f"{lay['name']}/{kind}"] = np.block(
                [[blocks[(i, j)] for j in range(pc)] for i in range(pr)])
    return out


def straddles(model) -> bool:
    """Whether some checkpoint chunk holds values of two blocks (so a save moves rows)."""
    for lay in model.state_blocks()["layers"]:
        for bounds, n in ((lay["rows"], lay["n_out"]), (lay["wcols"], lay["n_in"] + 1)):
            chunk = max(b - a for a, b in bounds)
            for b0, b1 in bounds:
                r = checkpoint_save._owned_range(b0, b1, chunk, n)
                if r is not None and r[1] > b1:
                    return True
    return False


def on_disk(path):
    meta = ck.read_metadata(path)
    return {name: zarr.open_array(os.path.join(path, name), mode="r")[:]
            for name in meta["arrays"]}


def train(model, X, y, directory, steps=8, every=2, **kw):
    return ck.train_with_checkpoints(model, X, y, steps=steps, every=every, batch_size=10,
                                     optimizer=OPT, directory=directory, keep=None, **kw)


# --------------------------------------------------------- stale momentum
@pytest.mark.parametrize("grid", ["4x1", "3x2", "1x5"])
def test_every_checkpoint_holds_the_state_of_its_step(client, data, tmp_path, grid):
    """Saves at several steps (no lineage cut between them): each checkpoint's every array
    equals what the model holds at that step, bit for bit."""
    X, y = data
    m = make_model().distribute(client, grid)
    assert straddles(m)
    w = m.get_weights()
    saved = 0
    for s in range(9):
        idx = ck.batch_indices(len(X), 10, s, 0)
        client.gather(m.train_step(X[idx], y[idx], OPT))
        if s % 2 == 0:
            path = ck.save(m, tmp_path, step=s + 1)
            held, disk = state(m), on_disk(path)
            assert set(disk) == set(held)
            for name in held:
                np.testing.assert_array_equal(disk[name], held[name], err_msg=f"{path} {name}")
            got = m.get_weights()
            for k, (W, b) in enumerate(got):
                np.testing.assert_array_equal(disk[f"dense{k}/w"], np.column_stack([W, b]))
            saved += 1
    assert saved == 5 and m._cuts == 0  # no lineage cut came between the saves
    assert not np.array_equal(got[0][0], w[0][0])
    m.close()


@pytest.mark.parametrize("grid", ["3x2", "1x5"])  # uneven both ways, and 5 ways
def test_resume_from_every_checkpoint_is_bit_equal(client, data, tmp_path, grid):
    X, y = data
    full = make_model().distribute(client, grid)
    r = train(full, X, y, tmp_path / "full")
    expected = state(full)
    full.close()
    assert r["steps"] == 8
    saved = ck.checkpoints(tmp_path / "full")
    assert [s for s, _ in saved] == [0, 2, 4, 6, 8]
    for step, path in saved[:-1]:
        d = tmp_path / f"from{step}"
        d.mkdir()
        shutil.copytree(path, d / os.path.basename(path))
        m = make_model(seed=99).distribute(client, grid)  # another init: all comes from disk
        lines = []
        r = train(m, X, y, d, log=lines.append)
        assert r["steps"] == 8 and len(r["losses"]) == 8 - step, lines
        assert lines[0] == f"resumed from {d / os.path.basename(path)} (step {step})"
        got = state(m)
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name],
                                          err_msg=f"{grid}, resumed at step {step}: {name}")
        m.close()


# ------------------------------------------------------------ checksums
def copy_of(path, tmp_path, name):
    d = tmp_path / name
    d.mkdir()
    shutil.copytree(path, d / os.path.basename(path))
    return str(d / os.path.basename(path))


def edit_attrs(path, change):
    f = os.path.join(path, "zarr.json")
    doc = json.load(open(f))
    change(doc["attributes"])
    json.dump(doc, open(f, "w"))


@pytest.fixture(scope="module")
def saved(client, data, tmp_path_factory):
    """A 2x2 run with checkpoints at steps 0, 2, 4: (directory, weights at each step)."""
    X, y = data
    d = tmp_path_factory.mktemp("saved")
    m = make_model().distribute(client, "2x2")
    train(m, X, y, d, steps=4, every=2)
    m.close()
    return d


def test_metadata_records_checksums(saved):
    meta = ck.read_metadata(saved / "ckpt-4")
    assert meta["version"] == 2 and meta["checksum"].startswith("sha256:")
    assert set(meta["arrays"]) == {"dense0/w", "dense0/v", "dense1/w", "dense1/v"}
    rec = meta["arrays"]["dense0/w"]
    assert rec["shape"] == [10, 9] and rec["chunks"] == [5, 5]
    from dask_ipar.io.checkpoint_format import chunk_digest

    values = zarr.open_array(saved / "ckpt-4" / "dense0" / "w")[:]
    assert rec["sha256"]["1.0"] == chunk_digest(values[5:10, 0:5])  # an independent hash
    assert len(rec["sha256"]) == 4


EDITS = {
    "step edited": lambda a: a.update(step=3),
    "momentum dropped": lambda a: a.update(has_velocity=False),
    "negative step": lambda a: a.update(step=-5),
    "step not a number": lambda a: a.update(step="twenty"),
    "layer without n_in": lambda a: a["layers"][0].pop("n_in"),
    "checksum removed": lambda a: a.pop("checksum"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_edited_metadata_is_refused_in_one_line(client, saved, tmp_path, edit):
    path = copy_of(saved / "ckpt-4", tmp_path, "e")
    edit_attrs(path, EDITS[edit])
    m = make_model().distribute(client, "2x1")
    before = m.get_weights()
    with pytest.raises(CheckpointCorrupt, match="corrupted or was edited") as err:
        ck.load(m, path)
    assert "\n" not in str(err.value) and path in str(err.value)
    for (W, b), (W0, b0) in zip(m.get_weights(), before):  # the model is as it was
        np.testing.assert_array_equal(W, W0)
    m.close()


def resign(a):
    """Recompute the metadata checksum after an edit: the fields alone must catch it."""
    from dask_ipar.io.checkpoint_format import meta_digest

    a["checksum"] = meta_digest(a)


FIELD_EDITS = {
    "negative step": (lambda a: a.update(step=-5), "step is -5"),
    "step not a number": (lambda a: a.update(step="twenty"), "step is 'twenty'"),
    "step of another directory": (lambda a: a.update(step=3), "says step 3 but the directory"),
    "layer without n_in": (lambda a: a["layers"][0].pop("n_in"), "layer 0 has no n_in"),
    "momentum dropped": (lambda a: a.update(has_velocity=False), "has_velocity = false"),
    "boolean version": (lambda a: a.update(version=True), "format version True"),
    "array checksum missing": (lambda a: a["arrays"]["dense1/v"]["sha256"].pop("0.0"),
                               "lacks checksums"),
}


@pytest.mark.parametrize("edit", list(FIELD_EDITS))
def test_each_metadata_field_is_checked(client, saved, tmp_path, edit):
    change, message = FIELD_EDITS[edit]
    path = copy_of(saved / "ckpt-4", tmp_path, "f")
    edit_attrs(path, lambda a: (change(a), resign(a)))
    m = make_model().distribute(client, "1x1")
    with pytest.raises(IparError, match=message) as err:
        ck.load(m, path)
    assert "\n" not in str(err.value)
    m.close()


def test_damaged_format_or_version_still_falls_back(client, saved, tmp_path):
    d = tmp_path / "d"
    shutil.copytree(saved, d)
    edit_attrs(str(d / "ckpt-4"), lambda a: a.update(version=3))
    edit_attrs(str(d / "ckpt-2"), lambda a: a.update(format="dask-ipar-checkpoinx"))
    (d / "ckpt-5").mkdir()  # a partial copy: no zarr.json
    m = make_model().distribute(client, "2x2")
    lines = []
    assert ck.load(m, d, fallback=True, log=lines.append)["step"] == 0
    assert [ln.split(":")[0] for ln in lines] == [
        f"skipped checkpoint {d / n}" for n in ("ckpt-5", "ckpt-4", "ckpt-2")]
    assert "no zarr.json" in lines[0] and "does not match its checksum" in lines[1]
    m.close()


def test_version_1_metadata_is_validated_too(client, saved, tmp_path):
    """Checkpoints of the first format (no checksums) load, and bad fields are refused."""
    path = copy_of(saved / "ckpt-4", tmp_path, "v1")

    def to_v1(a):
        a["version"] = 1
        a.pop("arrays")
        a.pop("checksum")
    edit_attrs(path, to_v1)
    m = make_model().distribute(client, "1x2")
    with pytest.warns(UserWarning, match="format version 1 .* cannot be verified"):
        assert ck.load(m, path)["step"] == 4
    edit_attrs(path, lambda a: a.update(step="twenty"))
    with pytest.raises(CheckpointCorrupt, match="step is 'twenty'"):
        ck.load(m, path)
    edit_attrs(path, lambda a: a.update(step=7))
    with pytest.raises(CheckpointCorrupt, match="says step 7 but the directory is ckpt-4"):
        ck.load(m, path)
    m.close()


def test_chunk_with_valid_crc_but_other_values_is_refused(client, saved, tmp_path):
    """Chunk files swapped (each one a valid Zarr chunk): only the SHA-256 sees it."""
    path = copy_of(saved / "ckpt-4", tmp_path, "swap")
    a = os.path.join(path, "dense0", "v", "c", "0", "0")
    b = os.path.join(path, "dense0", "v", "c", "1", "0")
    tmp = a + ".x"
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)
    m = make_model().distribute(client, "4x1")
    with pytest.raises(CheckpointCorrupt, match=r"chunk \d\.0 of array ckpt-4/dense0/v does "
                                                "not match its checksum"):
        ck.load(m, path)
    m.close()


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(client, data, saved,
                                                                  tmp_path):
    X, y = data
    d = tmp_path / "d"
    shutil.copytree(saved, d)
    # the newest has a damaged chunk, LATEST holds garbage bytes
    f = d / "ckpt-4" / "dense1" / "w" / "c" / "0" / "0"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))
    (d / "LATEST").write_bytes(b"\xff\xfeckpt-\x00")
    assert ck.latest(d) == str(d / "ckpt-4")  # garbage pointer: the highest step on disk
    ref = make_model().distribute(client, "2x2")
    train(ref, X, y, tmp_path / "ref", steps=6, every=2)
    expected = state(ref)
    ref.close()

    m = make_model().distribute(client, "2x2")
    lines = []
    r = train(m, X, y, d, steps=6, every=2, log=lines.append)
    assert lines[0].startswith(f"skipped checkpoint {d / 'ckpt-4'}: ")
    assert "CRC32C" in lines[0] and "\n" not in lines[0]
    assert lines[1] == f"resumed from {d / 'ckpt-2'} (step 2)"
    assert r["steps"] == 6 and len(r["losses"]) == 4
    got = state(m)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name])
    # the damaged ckpt-4 was written again; none is left that does not verify
    for _, path in ck.checkpoints(d):
        ck.read_metadata(path)
    m.close()


def test_no_checkpoint_verifies(client, saved, tmp_path):
    d = tmp_path / "d"
    shutil.copytree(saved, d)
    for path in (d / "ckpt-0", d / "ckpt-2", d / "ckpt-4"):
        edit_attrs(str(path), lambda a: a.update(grid=[9, 9]))
    m = make_model().distribute(client, "2x2")
    lines = []
    with pytest.raises(CheckpointCorrupt, match="none of the 3 checkpoints") as err:
        ck.load(m, d, fallback=True, log=lines.append)
    assert "ckpt-4 (" in str(err.value) and "ckpt-0 (" in str(err.value)
    assert len(lines) == 3
    m.close()


def test_stale_temporary_directories_are_removed_at_the_next_save(client, saved, tmp_path):
    d = tmp_path / "d"
    shutil.copytree(saved, d)
    old = d / "ckpt-5.tmp-0123456789ab"
    (old / "dense0").mkdir(parents=True)
    aside = d / "ckpt-2.old-01234567"
    aside.mkdir()
    pointer = d / "LATEST.tmp-89abcdef"
    pointer.write_text("ckpt-9\n")
    other = d / "notes.tmp-1"  # not ours: kept
    other.write_text("x")
    past = time.time() - 3600
    for p in (old, aside, pointer):
        os.utime(p, (past, past))
    fresh = d / "ckpt-7.tmp-ba9876543210"  # newer than the save's start: maybe in progress
    fresh.mkdir()
    future = time.time() + 3600
    os.utime(fresh, (future, future))
    m = make_model().distribute(client, "2x2")
    ck.load(m, d)
    ck.save(m, d, step=6)
    left = sorted(os.listdir(d))
    assert "ckpt-6" in left and fresh.name in left and other.name in left
    assert old.name not in left and aside.name not in left and pointer.name not in left
    m.close()


# ----------------------------------------------------- closed / lost state
@pytest.fixture
def fresh2():
    """A client on a cluster of its own (2 worker processes): these tests break it."""
    from distributed import Client, LocalCluster

    logging.getLogger("distributed").setLevel(logging.CRITICAL)
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as c:
        yield c


def test_closed_model_refuses_everything(client, data, tmp_path):
    X, y = data
    m = make_model().distribute(client, "2x2")
    m.fit(X, y, batch_size=10, optimizer=OPT, measure=False)
    m.close()
    for call in (m.get_weights, lambda: m.fit(X, y, batch_size=10),
                 lambda: ck.save(m, tmp_path), lambda: m.evaluate(X, y),
                 lambda: m.predict(X), lambda: m.gradients(X, y), m.state_blocks,
                 lambda: m.distribute(client, "2x2"), lambda: ck.load(m, tmp_path)):
        with pytest.raises(IparError, match="this model was closed"):
            call()
    assert not os.listdir(tmp_path)


def test_restarted_workers_give_one_clear_error(fresh2, data, tmp_path):
    X, y = data
    c = fresh2
    m = make_model().distribute(c, "1x2")
    m.fit(X, y, batch_size=10, optimizer=OPT, measure=False)
    c.restart()
    for call in (m.get_weights, lambda: m.fit(X, y, batch_size=10),
                 lambda: ck.save(m, tmp_path), lambda: m.evaluate(X, y),
                 lambda: m.distribute(c, "2x1")):
        with pytest.raises(IparError, match="state on the cluster is lost"):
            call()
    m.close()


def test_a_failed_step_raises_its_own_error(fresh2, data):
    """A kernel that fails on a worker: the caller sees that error, not a guess."""
    X, y = data
    c = fresh2
    m = make_model().distribute(c, "1x2")
    victim = m.binding.worker(0, 1)
    c.run(_break_updates, workers=[victim])
    c.gather(m.train_step(X[:10], y[:10], OPT))  # the forward pass still works
    # the failing worker's own RuntimeError, or a peer program relaying it ("step ... stopped
    # on worker ...: RuntimeError on ...: injected update failure"), whichever block is seen first
    with pytest.raises((RuntimeError, IparError), match="injected update failure") as err:
        for _ in range(3):
            m.get_weights()
            c.gather(m.train_step(X[:10], y[:10], OPT))
    assert "state on the cluster is lost" not in str(err.value)
    m.close()


def _break_updates():
    import dask_ipar.kernels.dense as K

    def broken(*args, **kwargs):
        raise RuntimeError("injected update failure")
    K.sgd_update = K.sgd_weight = K.sgd_velocity = broken


def test_worker_killed_then_get_weights_gives_one_clear_error(fresh2, data):
    import signal

    X, y = data
    c = fresh2
    m = make_model().distribute(c, "1x2")
    m.fit(X, y, batch_size=10, optimizer=OPT, measure=False)
    victim = m.binding.worker(0, 1)
    os.kill(c.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
    with pytest.raises(IparError, match=f"lost: worker {victim} of grid cell"):
        m.get_weights()  # at once, while the futures still look finished
    m.close()


# -------------------------------------------------------- storage faults
@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs (root only; skipped where mounting is not allowed)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2M", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(mnt):
    with open(mnt / "filler", "wb", buffering=0) as f:  # unbuffered: close cannot fail
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


@pytest.mark.parametrize("fault", ["disk full", "read-only"])
def test_storage_fault_ends_the_save_at_once(client, data, small_fs, fault):
    X, y = data
    m = make_model().distribute(client, "2x2")
    d = small_fs / "ck"
    first = ck.save(m, d, step=0)
    m.fit(X, y, batch_size=10, optimizer=OPT, measure=False)
    if fault == "disk full":
        fill(small_fs)
    else:
        subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    t0 = time.monotonic()
    with pytest.raises(CheckpointStorageError) as err:
        ck.save(m, d, step=4)
    took = time.monotonic() - t0
    msg = str(err.value)
    errno_text = "No space left on device" if fault == "disk full" else "Read-only file system"
    assert errno_text in msg and str(d) in msg and "\n" not in msg
    assert took < 5, took
    assert ck.checkpoints(d) == [(0, first)] and ck.latest(d) == first
    if fault == "disk full":
        assert sorted(os.listdir(d)) == ["LATEST", "ckpt-0"]  # the failed write is gone
    other = make_model(seed=5).distribute(client, "1x1")
    assert ck.load(other, d)["step"] == 0  # the earlier checkpoint verifies
    other.close()
    m.close()


def test_worker_side_write_error_is_reported_not_raised(small_fs):
    """The writer task returns the storage error (no "Compute Failed" dump on the worker)."""
    from zarr.codecs import Crc32cCodec, ZstdCodec

    path = str(small_fs / "a")
    zarr.create_array(path, shape=(64, 64), chunks=(32, 32), dtype="float64",
                      fill_value=np.nan, compressors=[ZstdCodec(level=1), Crc32cCodec()])
    fill(small_fs)
    block = np.random.default_rng(0).standard_normal((64, 64))
    res = checkpoint_tasks._write_region(path, 0, 64, 0, 64, [(0, 64, 0, 64)], block)
    assert res["errno"] == 28 and "No space left on device" in res["error"]


def run_cli(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "dask_ipar.cli", "train", "--no-progress",
                           "--no-dashboard", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_cli_disk_full_exits_2_with_one_line(small_fs, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("checkpoint: {keep: null}\n")
    t0 = time.monotonic()
    proc = run_cli("--config", str(cfg), "--grid", "1x2", "--dtype", "float64", "--epochs", "3",
                   "--checkpoint-dir", str(small_fs / "ck"), "--checkpoint-every", "4")
    took = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and "No space left on device" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Compute Failed" not in proc.stderr
    assert took < 120
    assert ck.latest(small_fs / "ck") is not None


def test_cli_resume_skips_a_damaged_checkpoint_quietly(tmp_path, client, capsys):
    from dask_ipar.cli.main import main

    d = tmp_path / "ck"
    common = ("--grid", "1x2", "--epochs", "1", "--batch", "128", "--checkpoint-dir", str(d),
              "--checkpoint-every", "4", "--json")
    # the checkpoints written in this process, on the session's cluster; the resumes below
    # are commands of their own (their stderr whole)
    rc = main(["train", "--no-progress", "--no-dashboard", *common, "--scheduler-address",
               client.scheduler.address])
    assert rc == 0, capsys.readouterr().err[-3000:]
    newest = ck.latest(d)
    f = os.path.join(newest, "dense0", "w", "c", "0", "0")
    raw = bytearray(open(f, "rb").read())
    raw[len(raw) // 2] ^= 0xFF
    open(f, "wb").write(bytes(raw))
    proc = run_cli(*common, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    skipped = [ln for ln in proc.stderr.splitlines() if "skipped checkpoint" in ln]
    assert len(skipped) == 1 and os.path.basename(newest) in skipped[0]
    assert "Compute Failed" not in proc.stderr and "Traceback" not in proc.stderr
    # every checkpoint damaged: one line, exit 2
    for _, path in ck.checkpoints(d):
        edit_attrs(path, lambda a: a.update(step=a["step"] + 1))
    proc = run_cli(*common, "--resume")
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert "none of the" in lines[-1] and "Traceback" not in proc.stderr
    assert "Compute Failed" not in proc.stderr
