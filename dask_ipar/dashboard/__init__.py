"""What users see of a run while it trains and after: the ``/ipar`` page in the Dask
dashboard, the per-cell timeline, and the charts the run card shares with it.

* :mod:`~dask_ipar.dashboard.timeline`: records to per-step bars, the critical phase (pure);
* :mod:`~dask_ipar.dashboard.svg`, :mod:`~dask_ipar.dashboard.render`: SVG and HTML (pure);
* :mod:`~dask_ipar.dashboard.recorder`: the worker plugin that records the timeline;
* :mod:`~dask_ipar.dashboard.page`: the scheduler plugin serving ``/ipar``;
* :mod:`~dask_ipar.dashboard.feed`: installing both, and the training callback feeding
  the page.
"""

from __future__ import annotations

__all__ = ["install_dashboard", "page_url", "DashboardFeed", "publish_test"]


def __getattr__(name):
    if name in __all__:
        from dask_ipar.dashboard import feed

        return getattr(feed, name)
    raise AttributeError(f"module 'dask_ipar.dashboard' has no attribute {name!r}")
