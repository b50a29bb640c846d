"""``python -m dask_ipar.cli``: the ``dask-ipar`` command."""

import sys

from dask_ipar.cli.main import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
