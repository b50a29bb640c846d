"""Write the SLURM job script shown in docs/hpc.md from dask-jobqueue itself.

    python scripts/hpc_docs.py          # rewrite the block in docs/hpc.md
    python scripts/hpc_docs.py --check  # exit 1 when the docs differ (tests run this)

The block between ``<!-- job_script:begin -->`` and ``<!-- job_script:end -->`` is the
script that ``cluster.kind: slurm`` submits for the example configuration below (the one
docs/hpc.md shows), made by the same dask-jobqueue call a run makes
(:func:`dask_ipar.runtime.batch.job_script`); only the scheduler's address is a stand-in.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import sys

from dask_ipar.config import DEFAULTS
from dask_ipar.runtime.batch import job_script

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "hpc.md"
BEGIN, END = "<!-- job_script:begin -->", "<!-- job_script:end -->"

#: The cluster section of the example dask-ipar.yaml in docs/hpc.md.
EXAMPLE = dict(kind="slurm", queue="compute", account="proj123", walltime="02:00:00",
               cores=16, memory="64GiB", processes=4, job_extra=["--exclusive"],
               job_script_prologue=["module load python/3.11",
                                    "source ~/venv/bin/activate"],
               python="python", log_directory="logs")


def block() -> str:
    cfg = copy.deepcopy(DEFAULTS)
    cfg["cluster"].update(EXAMPLE)
    script = job_script(cfg, n_workers=8, scheduler_address="tcp://login1:8786")
    return f"{BEGIN}\n```bash\n{script.rstrip()}\n```\n{END}"


def rewritten(text: str) -> str:
    i, j = text.index(BEGIN), text.index(END) + len(END)
    return text[:i] + block() + text[j:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only compare; exit 1 on a change")
    args = p.parse_args(argv)
    text = DOC.read_text()
    new = rewritten(text)
    if args.check:
        if new != text:
            print(f"{DOC} is out of date: run python scripts/hpc_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
