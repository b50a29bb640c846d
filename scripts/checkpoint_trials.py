"""Checkpoint fault trials through the command line, as a user would meet them.

1. Resume from a copy of every checkpoint: a float64 ``dask-ipar train`` run on each grid
   (default 4x1 and 1x4, ``--checkpoint-every 25``, all checkpoints kept) is resumed from a
   copy of each of its checkpoints alone; the final checkpoint's arrays must equal the
   uninterrupted run's bit for bit.
2. Storage faults (root only: a tmpfs is mounted): the disk fills, or the file system is
   remounted read-only, right after a checkpoint; the run must exit 2 with one error line
   and no traceback, and the earlier checkpoints must still load.

Usage: ``python scripts/checkpoint_trials.py [--grids 4x1,1x4] [--every 25] [--epochs 10]``.
Prints one line per trial and a summary; exits 1 when any trial fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import zarr

from dask_ipar.io import checkpoint as ck
def cli(*args, on_line=None):
    """Run ``dask-ipar train``; returns (exit code, stderr lines with times, seconds)."""
    cmd = [sys.executable, "-m", "dask_ipar.cli", "train", "--no-progress", "--no-dashboard",
           *args]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:
        lines.append((time.monotonic() - t0, line.rstrip("\n")))
        if on_line is not None:
            on_line(line)
    proc.wait()
    return proc.returncode, lines, time.monotonic() - t0


def arrays(path):
    meta = ck.read_metadata(path)
    return {n: zarr.open_array(os.path.join(path, n), mode="r")[:] for n in meta["arrays"]}


def resume_trials(grid, every, epochs, work):
    cfg = os.path.join(work, "keep-all.yaml")
    with open(cfg, "w") as f:
        f.write("checkpoint: {keep: null}\n")
    common = ("--config", cfg, "--grid", grid, "--dtype", "float64", "--epochs", str(epochs),
              "--checkpoint-every", str(every))
    full = os.path.join(work, f"full-{grid}")
    rc, lines, secs = cli(*common, "--checkpoint-dir", full)
    if rc != 0:
        print("\n".join(ln for _, ln in lines[-20:]))
        return [(f"{grid} uninterrupted run", False, f"exit {rc}")]
    saved = ck.checkpoints(full)
    final = arrays(saved[-1][1])
    out = [(f"{grid} uninterrupted run", True, f"{saved[-1][0]} steps, {len(saved)} "
                                               f"checkpoints, {secs:.1f} s")]
    for step, path in saved[:-1]:
        d = os.path.join(work, f"from-{grid}-{step}")
        os.makedirs(d)
        shutil.copytree(path, os.path.join(d, os.path.basename(path)))
        rc, lines, secs = cli(*common, "--checkpoint-dir", d, "--resume")
        if rc != 0:
            out.append((f"{grid} resumed from ckpt-{step}", False, f"exit {rc}: "
                        f"{lines[-1][1] if lines else ''}"))
            continue
        got = arrays(ck.latest(d))
        worst = max(float(np.abs(got[n] - final[n]).max()) for n in final)
        equal = all(np.array_equal(got[n], final[n]) for n in final)
        out.append((f"{grid} resumed from ckpt-{step}", equal,
                    "bit-equal" if equal else f"max difference {worst:.3g}"))
    return out


def storage_trial(kind, work):
    mnt = os.path.join(work, f"fs-{kind}")
    os.makedirs(mnt)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64M", "tmpfs", mnt],
                      capture_output=True).returncode != 0:
        return [(f"{kind} save", None, "skipped: cannot mount a tmpfs (needs root)")]
    try:
        d = os.path.join(mnt, "ck")
        fired = {}

        def on_line(line):
            if "checkpoint" in line and "(step 50)" in line and not fired:
                fired["t"] = time.monotonic()
                if kind == "disk full":
                    with open(os.path.join(mnt, "filler"), "wb") as f:
                        try:
                            while True:
                                f.write(b"\0" * (1 << 20))
                        except OSError:
                            pass
                else:
                    subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)

        t0 = time.monotonic()
        rc, lines, _ = cli("--grid", "2x2", "--dtype", "float64", "--epochs", "10",
                           "--checkpoint-dir", d, "--checkpoint-every", "25", on_line=on_line)
        end = time.monotonic()
        errors = [(t, ln) for t, ln in lines if "error" in ln.lower()]
        text = "\n".join(ln for _, ln in lines)
        ok = (rc == 2 and len(errors) == 1 and "Traceback" not in text
              and "Compute Failed" not in text)
        exit_after = end - (t0 + errors[0][0]) if errors else float("nan")
        ok = ok and exit_after < 5
        left = [s for s, _ in ck.checkpoints(d)]
        detail = (f"exit {rc}, {len(errors)} error line(s), exit {exit_after:.2f} s after the "
                  f"error line, {end - fired.get('t', end):.2f} s after the fault was made; "
                  f"checkpoints left {left}; "
                  f"{errors[0][1].split('error: ', 1)[-1] if errors else text[-300:]}")
        return [(f"{kind} save", ok, detail)]
    finally:
        subprocess.run(["umount", "-l", mnt], capture_output=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grids", default="4x1,1x4")
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--no-storage", action="store_true", help="skip the storage trials")
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="ckpt-trials-")
    results = []
    try:
        for grid in args.grids.split(","):
            for r in resume_trials(grid, args.every, args.epochs, work):
                print(("PASS" if r[1] else "FAIL"), *r[::2], sep="  ", flush=True)
                results.append(r)
        if not args.no_storage:
            for kind in ("disk full", "read-only"):
                for r in storage_trial(kind, work):
                    print({True: "PASS", False: "FAIL", None: "SKIP"}[r[1]], *r[::2],
                          sep="  ", flush=True)
                    results.append(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    failed = [r for r in results if r[1] is False]
    print(f"{len(results) - len(failed)} of {len(results)} trials passed or skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
