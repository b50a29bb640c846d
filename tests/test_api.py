"""The public names: every module's ``__all__`` resolves, and the package imports lazily."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import dask_ipar

pytestmark = pytest.mark.fast  # no cluster: graphs, kernels and formulas only

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


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for attr in parts[k:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_docs_and_docstrings_name_only_what_exists():
    """Every dotted ``dask_ipar.…`` name in the docs, the README and the package's own
    text is a module or an attribute that exists (no name left behind by a move)."""
    import pathlib
    import re

    root = pathlib.Path(dask_ipar.__file__).parent
    files = [*root.parent.joinpath("docs").glob("*.md"), root.parent / "README.md",
             *root.rglob("*.py")]
    pattern = re.compile(r"\bdask_ipar(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
    missing = {}
    for path in files:
        if not path.exists():
            continue
        for m in pattern.finditer(path.read_text()):
            name = m.group(0)
            if not name.endswith((".py", ".md")) and not _resolves(name):
                missing.setdefault(name, path.name)
    assert not missing, f"names that do not exist: {missing}"
