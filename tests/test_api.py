"""The public names: every module's ``__all__`` resolves, and the package imports lazily."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import dask_ipar

MODULES = sorted(m.name for m in pkgutil.walk_packages(dask_ipar.__path__, "dask_ipar."))


@pytest.mark.parametrize("name", MODULES)
def test_every_name_in_all_resolves(name):
    module = importlib.import_module(name)
    names = getattr(module, "__all__", None)
    assert names is not None, f"{name} has no __all__"
    assert len(names) == len(set(names)), f"{name}.__all__ repeats a name"
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names {missing}, which it does not define"


def test_top_level_names_resolve():
    for n in dask_ipar.__all__:
        assert getattr(dask_ipar, n) is not None
