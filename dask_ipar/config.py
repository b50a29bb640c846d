"""The ``dask-ipar.yaml`` configuration, registered into ``dask.config`` under ``ipar.*``.

Where the effective configuration comes from, lowest priority first:

1. the defaults below (:data:`DEFAULTS`, registered with ``dask.config.update_defaults``
   when this module is imported, so ``dask.config.get("ipar.optimizer.lr")`` works);
2. one YAML file: the ``path`` given to :func:`load_config`, else ``$DASK_IPAR_CONFIG``,
   else ``./dask-ipar.yaml`` when it exists;
3. dask's environment variables ``DASK_IPAR__<SECTION>__<KEY>``
   (for example ``DASK_IPAR__OPTIMIZER__LR=0.01``);
4. command-line flags, through :func:`apply_overrides` (flags left unset do not count).

Keys may be written with ``-`` or ``_`` (``weight-decay`` and ``weight_decay`` are the
same key); they are normalised to ``_``. The file may hold the settings at its top
level or under an ``ipar:`` key, so a ``dask-ipar.yaml`` can also be dropped into
dask's own config directory (``~/.config/dask/``).

Example ``dask-ipar.yaml``::

    grid: 2x2
    model: {hidden: [256, 128], dtype: float32}
    optimizer: {kind: sgd, lr: 0.05, momentum: 0.9}
    train: {epochs: 20, batch: 256}
    data: {path: /scratch/me/train.zarr}
    cluster:
      kind: slurm
      queue: compute
      account: proj123
      walltime: "02:00:00"
      cores: 8
      memory: 32GiB
      processes: 2
      job_extra: ["--exclusive"]
    checkpoint: {dir: /scratch/me/ckpt, every: 100}
"""

from __future__ import annotations

import copy
import difflib
import os
import re

import dask.config

from dask_ipar.errors import IparError

__all__ = [
    "DEFAULTS",
    "CLUSTER_KINDS",
    "ENV_VAR",
    "DEFAULT_FILE",
    "load_config",
    "apply_overrides",
    "validate",
    "register",
    "to_yaml",
    "ConfigError",
]

#: Environment variable naming the config file.
ENV_VAR = "DASK_IPAR_CONFIG"
#: File looked for in the current directory.
DEFAULT_FILE = "dask-ipar.yaml"
#: Accepted values of ``cluster.kind``.
CLUSTER_KINDS = ("local", "slurm", "pbs", "lsf", "sge")

#: Every setting and its default. ``None`` means "not set" (decided at run time).
DEFAULTS: dict = {
    "model": {
        "kind": "mlp",  # mlp | cnn (conv layers of `filters`, then `hidden` dense layers)
        "hidden": [128, 64],  # hidden layer widths
        "filters": [16, 32],  # cnn: each a 3x3 'same' ReLU conv followed by 2x2 max pooling
        "conv": "domain",  # cnn: domain | model | batch | auto (the planner picks per layer)
        "dtype": "float32",  # float32 | float64
    },
    "grid": None,  # "PRxPC", e.g. "2x2"; None: 1 x workers (pure batch)
    "data": {
        "path": None,  # .npz, .npy, Zarr group or HDF5 file; None: bundled digits
        "test_fraction": 0.2,  # held-out share when the file has no test split
        "val_fraction": 0.0,  # share of the training split held out for validation
        "standardize": True,  # per-feature standardization of data.path, fitted on training
        "input_shape": None,  # [C, H, W] of images stored flat (n, C*H*W), for the cnn
        "shuffle_window": 8,  # chunks per local shuffle of stored data (0: full shuffle)
    },
    # kind: sgd | adam | adamw; lr None: 0.05 for sgd, 0.001 for adam and adamw;
    # schedule: none | step:N[:GAMMA] | cosine[:MIN] | warmup:N[+cosine|+step:N[:GAMMA]]
    # clip_norm: scale the gradients to this global 2-norm at most (null: no clipping)
    "optimizer": {"kind": "sgd", "lr": None, "momentum": 0.9, "nesterov": False,
                  "weight_decay": 1.0e-4, "schedule": None, "clip_norm": None},
    # executor: programs (two dask tasks per worker and step) | graph (a dask task per kernel)
    # patience: stop when the validation loss has not improved for this many epochs
    # replicas: every this many steps each grid cell's state is copied to another worker,
    # which rebuilds a lost worker's without a checkpoint (0: off)
    # steps_per_program: consecutive steps per submission, 1-16 or auto (16 for small models)
    "train": {"epochs": 10, "batch": 64, "seed": 0, "executor": "programs", "patience": None,
              "replicas": 10, "steps_per_program": "auto"},
    "cluster": {
        "kind": "local",  # local | slurm | pbs | lsf | sge
        "scheduler_address": None,  # join this running cluster instead
        "workers": None,  # None: the grid's Pr*Pc
        "queue": None,  # queue / partition of the batch system
        "account": None,  # project to charge
        "walltime": "01:00:00",
        "cores": None,  # per job; local: None means all CPUs of the machine
        "memory": "4GiB",  # per job (jobqueue only)
        "processes": 1,  # worker processes per job
        "job_extra": [],  # extra scheduler directives, e.g. ["--exclusive"]
        # lines run in each job before the workers start, e.g. ["module load python/3.11",
        # "source ~/venv/bin/activate"]
        "job_script_prologue": [],
        "python": None,  # the Python the jobs run (None: this one, sys.executable)
        "log_directory": None,  # where the jobs' output files go (None: the working dir)
        "interface": None,  # network interface of the workers, e.g. ib0
        "local_directory": None,  # worker scratch directory
        "dashboard": True,  # serve the dashboard on 127.0.0.1 (needs bokeh)
        "tls": False,  # use dask's distributed.comm.tls settings for all connections
        "reuse_memory": True,  # workers keep freed block memory for reuse (glibc malloc)
        "connect_timeout": 10.0,  # seconds to reach scheduler_address
        "wait_timeout": 600.0,  # seconds to wait for all workers to join
    },
    "machine": None,  # YAML machine file (alpha, bandwidth) for the cost model
    # whose BLAS multiplies NumPy blocks: auto (PyTorch's on Intel CPUs where installed) |
    # numpy | torch
    "matmul": "auto",
    "checkpoint": {
        "dir": None,  # where checkpoints go; None: no checkpoints
        "every": 0,  # save every N training steps (0: only at the end)
        "keep": 3,  # how many checkpoints to keep (None: all)
    },
}

dask.config.update_defaults({"ipar": copy.deepcopy(DEFAULTS)})


# ---------------------------------------------------------------- helpers
def _norm_keys(obj):
    """Copy of ``obj`` with every mapping key's ``-`` turned into ``_``."""
    if isinstance(obj, dict):
        return {str(k).replace("-", "_"): _norm_keys(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_norm_keys(v) for v in obj]
    return obj


def _merge(base: dict, new: dict) -> dict:
    """Deep merge: values of ``new`` win, nested mappings merge key by key."""
    out = copy.deepcopy(base)
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _read_yaml(path: str) -> dict:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise IparError(
            f"config file {path!r} does not exist. Check the path, or omit --config to use "
            f"./{DEFAULT_FILE} or ${ENV_VAR}."
        ) from None
    except yaml.YAMLError as exc:
        raise IparError(f"config file {path!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise IparError(
            f"config file {path!r} holds a {type(data).__name__}, expected a mapping of "
            "sections (model, grid, optimizer, train, cluster, checkpoint, ...)."
        )
    data = _norm_keys(data)
    if set(data) == {"ipar"} and isinstance(data["ipar"], dict):
        data = data["ipar"]
    cl = data.get("cluster")
    if isinstance(cl, dict) and _is_int(cl.get("walltime")):
        # YAML 1.1 reads an unquoted 2:00:00 as the sexagesimal integer 7200
        h, rem = divmod(cl["walltime"], 3600)
        cl["walltime"] = f"{h:02d}:{rem // 60:02d}:{rem % 60:02d}"
    return data


def _config_path(path) -> str | None:
    if path is not None:
        return os.fspath(path)
    env = os.environ.get(ENV_VAR)
    if env:
        return env
    if os.path.exists(DEFAULT_FILE):
        return DEFAULT_FILE
    return None


def _env_settings() -> dict:
    """``DASK_IPAR__...`` variables as a nested dict (dask's own parsing rules)."""
    env = dask.config.collect_env(os.environ)
    return _norm_keys(env.get("ipar", {}) or {})


# ------------------------------------------------------------------ public
def load_config(path=None, *, register_config: bool = True, check: bool = True) -> dict:
    """The effective configuration: defaults, then one YAML file, then ``DASK_IPAR__*``.

    Parameters
    ----------
    path : str or path-like, optional
        The YAML file. Default: ``$DASK_IPAR_CONFIG``, else ``./dask-ipar.yaml`` if present,
        else none (defaults and environment only).
    register_config : bool
        Also set the result into ``dask.config`` under ``ipar`` (for this process).
    check : bool
        Run :func:`validate` on the result.

    Returns
    -------
    dict
        A fresh nested dict with every key of :data:`DEFAULTS`, plus ``cfg["_file"]``:
        the YAML file that was read (None when there was none).

    Examples
    --------
    >>> cfg = load_config(register_config=False)          # doctest: +SKIP
    >>> cfg["optimizer"]["lr"]                            # doctest: +SKIP
    0.05
    """
    file = _config_path(path)
    cfg = copy.deepcopy(DEFAULTS)
    if file is not None:
        cfg = _merge(cfg, _read_yaml(file))
    cfg = _merge(cfg, _env_settings())
    if check:
        validate(cfg)
    cfg["_file"] = file
    if register_config:
        register(cfg)
    return cfg


def register(cfg: dict) -> None:
    """Put ``cfg`` into ``dask.config`` under ``ipar`` (visible to ``dask.config.get``)."""
    clean = {k: v for k, v in cfg.items() if not k.startswith("_")}
    dask.config.update(dask.config.config, {"ipar": copy.deepcopy(clean)}, priority="new")


def _set_dotted(cfg: dict, dotted: str, value) -> None:
    parts = dotted.replace("-", "_").split(".")
    node = cfg
    for i, p in enumerate(parts[:-1]):
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        elif not isinstance(nxt, dict):
            raise IparError(
                f"override {dotted!r}: {'.'.join(parts[: i + 1])} is a value, not a section."
            )
        node = nxt
    node[parts[-1]] = value


def apply_overrides(cfg: dict, overrides: dict) -> dict:
    """A copy of ``cfg`` with ``overrides`` applied; overrides whose value is None are ignored.

    Parameters
    ----------
    cfg : dict
        From :func:`load_config`.
    overrides : dict
        Dotted keys to values, e.g. ``{"optimizer.lr": args.lr, "grid": args.grid}``;
        nested dicts are flattened the same way.

    Examples
    --------
    >>> cfg = {"optimizer": {"lr": 0.05}, "grid": None}
    >>> apply_overrides(cfg, {"optimizer.lr": 0.1, "grid": None})
    {'optimizer': {'lr': 0.1}, 'grid': None}
    """
    out = copy.deepcopy(cfg)

    def walk(prefix, d):
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                walk(key + ".", v)
            elif v is not None:
                _set_dotted(out, key, copy.deepcopy(v))

    walk("", overrides)
    return out


def to_yaml(cfg: dict) -> str:
    """The configuration as YAML text (what ``dask-ipar config show`` prints)."""
    import yaml

    clean = {k: v for k, v in cfg.items() if not k.startswith("_")}
    return yaml.safe_dump(clean, sort_keys=False, default_flow_style=False)


# --------------------------------------------------------------- validate
_WALLTIME = re.compile(r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$")


def _unknown(where: str, given: dict, allowed: dict):
    for k in given:
        if k.startswith("_") and where == "":
            continue
        if k not in allowed:
            near = difflib.get_close_matches(k, list(allowed), n=1)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            known = ", ".join(sorted(allowed))
            raise IparError(
                f"unknown config key {where + k!r}; expected one of: {known}.{hint} "
                "Fix the spelling in the config file or the DASK_IPAR__ variable."
            )


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


class ConfigError(IparError):
    """A setting that is not valid: which key, the value given, what was expected."""

    def __init__(self, key, value, expected, fix=""):
        self.key, self.value, self.expected, self.fix = key, value, expected, fix
        super().__init__(
            f"config {key} is {value!r}, expected {expected}.{(' ' + fix) if fix else ''}")


def _need(cond, key, value, expected, fix=""):
    if not cond:
        raise ConfigError(key, value, expected, fix)


def validate(cfg: dict) -> dict:
    """Check every setting; raise :class:`~dask_ipar.errors.IparError` on the first bad one.

    Messages name the key, the value given, what was expected and how to fix it.
    Returns ``cfg`` unchanged.
    """
    from dask.utils import parse_bytes

    from dask_ipar.layout.grid import parse_grid

    if not isinstance(cfg, dict):
        raise IparError(f"the configuration must be a mapping, got {type(cfg).__name__}.")
    _unknown("", cfg, DEFAULTS)
    for sec, default in DEFAULTS.items():
        if isinstance(default, dict):
            val = cfg.get(sec, default)
            _need(isinstance(val, dict), sec, val, "a mapping of settings",
                  f"Write it as '{sec}:' followed by indented keys.")
            _unknown(sec + ".", val, default)

    m = cfg.get("model", {})
    hidden = m.get("hidden", DEFAULTS["model"]["hidden"])
    _need(isinstance(hidden, list) and all(_is_int(h) and h > 0 for h in hidden),
          "model.hidden", hidden, "a list of positive integers such as [128, 64]")
    _need(m.get("dtype") in ("float32", "float64"), "model.dtype", m.get("dtype"),
          "float32 or float64")
    _need(m.get("kind", "mlp") in ("mlp", "cnn"), "model.kind", m.get("kind"), "mlp or cnn")
    _need(m.get("conv", "domain") in ("domain", "model", "batch", "auto"), "model.conv",
          m.get("conv"), "domain, model, batch or auto")
    filters = m.get("filters", DEFAULTS["model"]["filters"])
    _need(isinstance(filters, list) and len(filters) >= 1
          and all(_is_int(f) and f > 0 for f in filters),
          "model.filters", filters, "a non-empty list of positive integers such as [16, 32]")

    grid = cfg.get("grid")
    if grid is not None:
        try:
            parse_grid(grid)
        except Exception:
            raise ConfigError("grid", grid, "PRxPC such as 2x2 (Pr model-parallel rows times "
                              "Pc batch-parallel columns)") from None

    d = cfg.get("data", {})
    _need(d.get("path") is None or isinstance(d.get("path"), str), "data.path", d.get("path"),
          "a file or directory path, or null for the bundled digits")
    tf = d.get("test_fraction")
    _need(_is_num(tf) and 0 <= tf < 1, "data.test_fraction", tf, "a number in [0, 1)")
    vf = d.get("val_fraction", 0.0)
    _need(_is_num(vf) and 0 <= vf < 1, "data.val_fraction", vf, "a number in [0, 1)")
    _need(isinstance(d.get("standardize", True), bool), "data.standardize",
          d.get("standardize"), "true or false")
    shp = d.get("input_shape")
    _need(shp is None or (isinstance(shp, (list, tuple)) and len(shp) == 3 and all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shp)),
        "data.input_shape", shp, "three positive integers C,H,W (null in a config: from the data)")
    sw = d.get("shuffle_window", 8)
    _need(isinstance(sw, int) and not isinstance(sw, bool) and sw >= 0, "data.shuffle_window",
          sw, "a whole number of chunks >= 0")

    o = cfg.get("optimizer", {})
    _need(o.get("kind", "sgd") in ("sgd", "adam", "adamw"), "optimizer.kind", o.get("kind"),
          "sgd, adam or adamw")
    _need(o.get("lr") is None or (_is_num(o["lr"]) and o["lr"] >= 0), "optimizer.lr",
          o.get("lr"), "a number >= 0 (or null: the optimizer's default)")
    for k in ("momentum", "weight_decay"):
        _need(_is_num(o.get(k)) and o.get(k) >= 0, f"optimizer.{k}", o.get(k),
              "a number >= 0")
    _need(isinstance(o.get("nesterov", False), bool), "optimizer.nesterov", o.get("nesterov"),
          "true or false")
    cn = o.get("clip_norm")
    _need(cn is None or (_is_num(cn) and cn > 0), "optimizer.clip_norm", cn,
          "a number > 0 (or null: no clipping)")
    _need(o["momentum"] < 1, "optimizer.momentum", o["momentum"], "a number < 1")
    if o.get("schedule") is not None:
        from dask_ipar.optim import parse_schedule

        try:
            parse_schedule(str(o["schedule"]), 1000)
        except IparError:
            raise ConfigError("optimizer.schedule", o["schedule"], "none, step:N[:GAMMA], "
                              "cosine[:MIN_FACTOR], warmup:N or warmup:N+cosine") from None

    t = cfg.get("train", {})
    for k in ("epochs", "batch"):
        _need(_is_int(t.get(k)) and t.get(k) >= 1, f"train.{k}", t.get(k),
              "a positive integer")
    _need(_is_int(t.get("seed")), "train.seed", t.get("seed"), "an integer")
    pt = t.get("patience")
    _need(pt is None or (_is_int(pt) and pt >= 1), "train.patience", pt,
          "a positive integer (epochs) or null")
    _need(t.get("executor") in ("graph", "programs"), "train.executor", t.get("executor"),
          "'graph' or 'programs'")
    rp = t.get("replicas", 0)
    _need(_is_int(rp) and rp >= 0, "train.replicas", rp,
          "a non-negative integer (steps between replica refreshes; 0: off)")
    sp = t.get("steps_per_program", "auto")
    # 16: runtime.steps.MAX_STEPS_PER_PROGRAM (not imported: the config stays below runtime)
    _need(sp == "auto" or (_is_int(sp) and 1 <= sp <= 16), "train.steps_per_program", sp,
          "a whole number from 1 to 16, or auto")

    c = cfg.get("cluster", {})
    _need(c.get("kind") in CLUSTER_KINDS, "cluster.kind", c.get("kind"),
          "one of " + ", ".join(CLUSTER_KINDS),
          "Use 'local' for this machine or the name of your batch system.")
    for k in ("workers", "cores"):
        v = c.get(k)
        _need(v is None or (_is_int(v) and v >= 1), f"cluster.{k}", v,
              "a positive integer or null")
    _need(_is_int(c.get("processes")) and c.get("processes") >= 1, "cluster.processes",
          c.get("processes"), "a positive integer (worker processes per job)")
    if c.get("cores") is not None and c.get("kind") != "local":
        _need(c["cores"] >= c["processes"], "cluster.cores", c["cores"],
              f"at least cluster.processes = {c['processes']} (each process needs a core)")
    wt = c.get("walltime")
    _need(isinstance(wt, str) and bool(_WALLTIME.match(wt)), "cluster.walltime", wt,
          "a time such as '01:30:00' or '2-00:00:00' (quote it in YAML)")
    mem = c.get("memory")
    ok = isinstance(mem, str)
    if ok:
        try:
            ok = parse_bytes(mem) > 0
        except (ValueError, TypeError):
            ok = False
    _need(ok, "cluster.memory", mem, "an amount such as '16GiB' or '4000MB'")
    for k in ("queue", "account", "interface", "local_directory", "scheduler_address",
              "python", "log_directory"):
        v = c.get(k)
        _need(v is None or isinstance(v, str), f"cluster.{k}", v, "a string or null")
    je = c.get("job_extra")
    _need(isinstance(je, list) and all(isinstance(s, str) for s in je), "cluster.job_extra", je,
          "a list of strings such as ['--exclusive']")
    jp = c.get("job_script_prologue")
    _need(isinstance(jp, list) and all(isinstance(s, str) for s in jp),
          "cluster.job_script_prologue", jp,
          "a list of shell lines such as ['module load python/3.11']")
    for k in ("dashboard", "tls", "reuse_memory"):
        _need(isinstance(c.get(k), bool), f"cluster.{k}", c.get(k), "true or false")
    for k in ("connect_timeout", "wait_timeout"):
        _need(_is_num(c.get(k)) and c.get(k) > 0, f"cluster.{k}", c.get(k),
              "a positive number of seconds")

    mf = cfg.get("machine")
    _need(mf is None or isinstance(mf, str), "machine", mf, "a YAML file path or null")
    _need(cfg.get("matmul", "auto") in ("auto", "numpy", "torch"), "matmul",
          cfg.get("matmul"), "auto (PyTorch's BLAS on Intel CPUs where installed), numpy "
          "or torch")

    ck = cfg.get("checkpoint", {})
    _need(ck.get("dir") is None or isinstance(ck.get("dir"), str), "checkpoint.dir",
          ck.get("dir"), "a directory path or null")
    _need(_is_int(ck.get("every")) and ck.get("every") >= 0, "checkpoint.every",
          ck.get("every"), "an integer >= 0 (0: save only at the end)")
    kp = ck.get("keep")
    _need(kp is None or (_is_int(kp) and kp >= 1), "checkpoint.keep", kp,
          "a positive integer or null (keep all)")
    return cfg
