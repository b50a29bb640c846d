"""Shared fixtures: one LocalCluster of real worker processes for the whole session."""

from __future__ import annotations

import logging

import pytest

N_WORKERS = 8


@pytest.fixture(scope="session")
def client():
    """A client on 8 worker processes (1 thread each): enough for every grid with P <= 8."""
    import dask
    from distributed import Client, LocalCluster

    logging.getLogger("distributed").setLevel(logging.ERROR)
    # 8 processes share 2 cores: the workers' 10 ms statistical profiler is the one
    # background cost worth switching off (nothing here reads profiles).
    from dask_ipar.runtime.cluster import worker_environment

    with dask.config.set({"distributed.worker.profile.enabled": False}), worker_environment():
        cluster = LocalCluster(
            n_workers=N_WORKERS, threads_per_worker=1, processes=True,
            host="127.0.0.1", dashboard_address="127.0.0.1:0",  # the /ipar page (tests)
        )
    c = Client(cluster)
    yield c
    c.close()
    cluster.close()


@pytest.fixture(scope="module")
def client4():
    """A cluster of 4 worker processes with nannies, for the tests that kill or stop
    workers (a module's own: the session cluster stays intact)."""
    from distributed import Client, LocalCluster

    logging.getLogger("distributed").setLevel(logging.CRITICAL)
    cluster = LocalCluster(n_workers=4, threads_per_worker=1, processes=True,
                           host="127.0.0.1", dashboard_address=None)
    c = Client(cluster)
    yield c
    c.close()
    cluster.close()
