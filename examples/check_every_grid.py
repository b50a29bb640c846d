"""Check every grid of P = 4 workers against single-process NumPy and the cost model.

Run: python examples/check_every_grid.py
"""

from distributed import Client, LocalCluster

from dask_ipar.layout.grid import factorizations
from dask_ipar.testing import check_mlp


def main(p=4):
    with LocalCluster(n_workers=p, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        for grid in factorizations(p):
            err = check_mlp(client, grid, steps=5)  # raises AssertionError on any mismatch
            worst = max(v for k, v in err.items() if k[:2] in ("dW", "db"))
            print(f"{grid}: worst gradient error {worst:.1e}, "
                  f"finite difference {err['finite_difference']:.1e}, bytes = model: OK")


if __name__ == "__main__":
    main()
