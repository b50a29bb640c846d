"""What ``dask-ipar train`` shows besides its result: the training page's address and
dask's performance report beside the run card."""

from __future__ import annotations

import contextlib
import os

__all__ = ["dashboard_setting", "performance_report_beside", "training_page"]


@contextlib.contextmanager
def performance_report_beside(path, command: str = "dask-ipar train"):
    """Record dask's performance report (inline bokeh) beside the run card, when one is
    asked for: ``<card>.dask.html``, linked from the card. Its "calling code" is the
    ``command`` the user typed (not the helper that opened the report)."""
    from dask_ipar.runtime.cluster import _has_bokeh

    out = {}
    if not path or not _has_bokeh():
        yield out
        return
    from distributed import get_client, performance_report

    fname = os.path.splitext(path)[0] + ".dask.html"
    report = performance_report(filename=fname, mode="inline")
    report.__enter__()
    try:
        yield out
    finally:  # written whether or not the training ended well, as ``with`` would
        get_client().sync(report.__aexit__, None, None, None, code=command)
    out["file"] = os.path.basename(fname)


def dashboard_setting(cfg):
    """The dask config under which ``train`` fits: ``--no-dashboard`` (``cluster.dashboard:
    false``) also turns off the ``/ipar`` page and its feed."""
    import dask

    if cfg["cluster"]["dashboard"]:
        return contextlib.nullcontext()
    return dask.config.set({"dask-ipar.dashboard": False})


def training_page(client, cfg) -> str | None:
    """The ``/ipar`` page's address where it answers (see the dashboard link's rules)."""
    from dask_ipar.dashboard import install_dashboard, page_url

    if not cfg["cluster"]["dashboard"] or not install_dashboard(client):
        return None
    return page_url(client)
