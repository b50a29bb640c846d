"""The dask-ipar.yaml configuration: defaults, file, DASK_IPAR__ variables, CLI overrides."""

from __future__ import annotations

import argparse
import json

import dask.config
import pytest
import yaml

from dask_ipar.config import DEFAULTS, apply_overrides, load_config, to_yaml, validate
from dask_ipar.errors import IparError

pytestmark = pytest.mark.fast  # no cluster: graphs, kernels and formulas only


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DASK_IPAR_CONFIG", raising=False)
    for k in list(__import__("os").environ):
        if k.startswith("DASK_IPAR__"):
            monkeypatch.delenv(k)
    with dask.config.set({}):  # restore dask.config afterwards
        yield


def _write(path, data):
    path.write_text(yaml.safe_dump(data))
    return path


def test_defaults_registered_in_dask_config():
    assert dask.config.get("ipar.optimizer.lr") == DEFAULTS["optimizer"]["lr"]
    cfg = load_config()
    assert cfg["_file"] is None
    assert {k: v for k, v in cfg.items() if k != "_file"} == DEFAULTS


def test_file_merges_over_defaults_and_registers(tmp_path):
    f = _write(tmp_path / "c.yaml", {"grid": "2x2", "optimizer": {"lr": 0.2},
                                     "cluster": {"kind": "slurm", "job-extra": ["--exclusive"]}})
    cfg = load_config(f)
    assert cfg["grid"] == "2x2" and cfg["optimizer"]["lr"] == 0.2
    assert cfg["optimizer"]["momentum"] == DEFAULTS["optimizer"]["momentum"]
    assert cfg["cluster"]["job_extra"] == ["--exclusive"]  # '-' normalised to '_'
    assert dask.config.get("ipar.optimizer.lr") == 0.2
    assert dask.config.get("ipar.grid") == "2x2"


def test_file_search_order(tmp_path, monkeypatch):
    _write(tmp_path / "dask-ipar.yaml", {"train": {"epochs": 3}})
    assert load_config()["train"]["epochs"] == 3
    other = _write(tmp_path / "other.yaml", {"ipar": {"train": {"epochs": 4}}})
    monkeypatch.setenv("DASK_IPAR_CONFIG", str(other))
    assert load_config()["train"]["epochs"] == 4  # $DASK_IPAR_CONFIG beats ./dask-ipar.yaml
    assert load_config(tmp_path / "dask-ipar.yaml")["train"]["epochs"] == 3  # path beats both


def test_env_vars_win_over_file(tmp_path, monkeypatch):
    f = _write(tmp_path / "c.yaml", {"optimizer": {"lr": 0.2}})
    monkeypatch.setenv("DASK_IPAR__OPTIMIZER__LR", "0.01")
    monkeypatch.setenv("DASK_IPAR__CLUSTER__QUEUE", "gpu")
    cfg = load_config(f)
    assert cfg["optimizer"]["lr"] == 0.01 and cfg["cluster"]["queue"] == "gpu"


def test_unquoted_walltime_is_read_as_time(tmp_path):
    (tmp_path / "c.yaml").write_text("cluster:\n  walltime: 2:30:00\n")
    assert load_config(tmp_path / "c.yaml")["cluster"]["walltime"] == "02:30:00"


def test_overrides_skip_none():
    cfg = load_config()
    out = apply_overrides(cfg, {"optimizer.lr": 0.5, "grid": None, "train.epochs": None,
                                "cluster": {"kind": "pbs", "queue": None}})
    assert out["optimizer"]["lr"] == 0.5
    assert out["train"]["epochs"] == DEFAULTS["train"]["epochs"]
    assert out["cluster"]["kind"] == "pbs" and out["cluster"]["queue"] is None
    assert cfg["optimizer"]["lr"] == DEFAULTS["optimizer"]["lr"]  # input untouched
    validate(out)


@pytest.mark.parametrize("patch, words", [
    ({"optimizer": {"lr": -1}}, ["optimizer.lr", "-1", ">= 0"]),
    ({"optimizer": {"momentum": 1.0}}, ["optimizer.momentum", "< 1"]),
    ({"optimzer": {"lr": 1}}, ["optimzer", "Did you mean 'optimizer'"]),
    ({"cluster": {"kind": "condor"}}, ["cluster.kind", "condor", "slurm"]),
    ({"cluster": {"walltime": "soon"}}, ["cluster.walltime", "01:30:00"]),
    ({"cluster": {"memory": "lots"}}, ["cluster.memory", "16GiB"]),
    ({"cluster": {"kind": "slurm", "cores": 2, "processes": 4}}, ["cluster.cores", "processes"]),
    ({"grid": "2by2"}, ["grid", "2by2", "PRxPC"]),
    ({"model": {"hidden": [64, 0]}}, ["model.hidden", "positive"]),
    ({"model": {"dtype": "float16"}}, ["model.dtype", "float64"]),
    ({"train": {"batch": 0}}, ["train.batch", "positive"]),
    ({"train": {"executor": "fused"}}, ["train.executor", "'fused'", "'programs'"]),
    ({"train": {"steps_per_program": 0}}, ["train.steps_per_program", "1 to 16, or auto"]),
    ({"checkpoint": {"every": -2}}, ["checkpoint.every"]),
    ({"checkpoint": {"evry": 2}}, ["checkpoint.evry", "every"]),
])
def test_validate_errors_are_clear(tmp_path, patch, words):
    f = _write(tmp_path / "bad.yaml", patch)
    with pytest.raises(IparError) as err:
        load_config(f)
    for w in words:
        assert w in str(err.value)


def test_bad_files(tmp_path):
    with pytest.raises(IparError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(IparError, match="expected a mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("a: [1, 2\n")
    with pytest.raises(IparError, match="not valid YAML"):
        load_config(tmp_path / "broken.yaml")


def test_config_show(tmp_path, capsys):
    from dask_ipar.cli import config as config_cli
    f = _write(tmp_path / "c.yaml", {"grid": "4x1", "checkpoint": {"dir": "ck", "every": 5}})
    parser = argparse.ArgumentParser()
    config_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["config", "show", "--config", str(f)])
    assert args.func(args) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["grid"] == "4x1" and shown["checkpoint"]["every"] == 5
    assert shown["cluster"] == DEFAULTS["cluster"]
    args = parser.parse_args(["config", "show", "--config", str(f), "--json"])
    assert args.func(args) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["checkpoint"]["dir"] == "ck"
    assert yaml.safe_load(to_yaml(shown)) == shown


def test_config_from_args(tmp_path):
    from dask_ipar.cli.config import TRAIN_FLAGS, config_from_args

    f = _write(tmp_path / "c.yaml", {"grid": "2x2", "train": {"epochs": 7},
                                     "checkpoint": {"dir": "ck", "every": 5}})
    args = argparse.Namespace(config=str(f), **{k: None for k in TRAIN_FLAGS},
                              no_dashboard=True)
    args.lr, args.checkpoint_every, args.cluster = 0.3, 9, "pbs"
    cfg = config_from_args(args)
    assert cfg["grid"] == "2x2" and cfg["train"]["epochs"] == 7  # file, flags unset
    assert cfg["optimizer"]["lr"] == 0.3 and cfg["checkpoint"]["every"] == 9  # flags win
    assert cfg["cluster"]["kind"] == "pbs" and cfg["cluster"]["dashboard"] is False
    assert cfg["_file"] == str(f) and dask.config.get("ipar.optimizer.lr") == 0.3
    args.momentum = 2.0  # a flag's bad value is named as the flag (a CLI user's terms)
    with pytest.raises(IparError, match=r"^--momentum 2.0: expected a number < 1\.$"):
        config_from_args(args)
    args.momentum, args.grid = None, "3"
    with pytest.raises(IparError, match=r"^--grid 3: expected PRxPC such as 2x2"):
        config_from_args(args)
    args.grid = None
    f.write_text("grid: '3'\n")  # the same value from the file is named as its key
    with pytest.raises(IparError, match="config grid is '3', expected PRxPC"):
        config_from_args(args)
