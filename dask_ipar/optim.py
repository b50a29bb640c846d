"""Optimizer settings and learning-rate schedules. The optimizer's state (momentum) lives
on the workers beside the weight slices; the learning rate of each step is a pure
function of the step (:meth:`SGD.at_step`), so a resumed run uses the rates an
uninterrupted one does."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from dask_ipar.errors import IparError

__all__ = ["SGD", "Adam", "AdamW", "StepLR", "CosineLR", "WarmupLR", "parse_schedule",
           "make_optimizer"]


def _check_number(owner, name, v, lo, *, integer=False):
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if not ok or isinstance(v, bool) or not v >= lo or v != v:
        kind = "an integer" if integer else "a number"
        raise IparError(f"{owner} {name} must be {kind} >= {lo}, got {v!r}.")


@dataclass(frozen=True)
class StepLR:
    """Multiply the rate by ``gamma`` every ``step_size`` steps."""

    step_size: int
    gamma: float = 0.1

    def __post_init__(self):
        _check_number("StepLR", "step_size", self.step_size, 1, integer=True)
        _check_number("StepLR", "gamma", self.gamma, 0.0)

    def factor(self, step: int) -> float:
        return self.gamma ** (step // self.step_size)


@dataclass(frozen=True)
class CosineLR:
    """Cosine decay from the rate to ``min_factor`` times it over ``total_steps`` steps
    (then held there)."""

    total_steps: int
    min_factor: float = 0.0

    def __post_init__(self):
        _check_number("CosineLR", "total_steps", self.total_steps, 1, integer=True)
        _check_number("CosineLR", "min_factor", self.min_factor, 0.0)

    def factor(self, step: int) -> float:
        t = min(step, self.total_steps) / self.total_steps
        return self.min_factor + (1 - self.min_factor) * 0.5 * (1 + math.cos(math.pi * t))


@dataclass(frozen=True)
class WarmupLR:
    """Linear warm-up over ``warmup_steps`` (step ``s`` gets ``(s + 1) / warmup_steps``
    of the rate), then ``then`` (another schedule, counted from the end of the warm-up)
    or the full rate."""

    warmup_steps: int
    then: StepLR | CosineLR | None = None

    def __post_init__(self):
        _check_number("WarmupLR", "warmup_steps", self.warmup_steps, 1, integer=True)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        return 1.0 if self.then is None else self.then.factor(step - self.warmup_steps)


def parse_schedule(text: str | None, total_steps: int):
    """A schedule from its CLI spelling: ``none``, ``step:N[:GAMMA]``, ``cosine``,
    ``warmup:N`` or ``warmup:N+cosine`` / ``warmup:N+step:M[:GAMMA]``. Cosine decays over
    the run's ``total_steps`` (minus the warm-up)."""
    if text is None or text.strip().lower() in ("", "none", "constant"):
        return None
    spec = text.strip().lower()

    def one(part, total):
        kind, *args = part.split(":")
        try:
            if kind == "step" and 1 <= len(args) <= 2:
                return StepLR(int(args[0]), float(args[1]) if len(args) > 1 else 0.1)
            if kind == "cosine" and len(args) <= 1:
                return CosineLR(max(total, 1), float(args[0]) if args else 0.0)
        except ValueError:
            pass
        raise IparError(
            f"{part!r} is not a learning-rate schedule; expected none, step:N[:GAMMA], "
            "cosine[:MIN_FACTOR], warmup:N or warmup:N+cosine (e.g. --lr-schedule "
            "warmup:100+cosine)")

    if spec.startswith("warmup:"):
        head, _, rest = spec.partition("+")
        try:
            n = int(head.split(":", 1)[1])
        except ValueError:
            n = 0
        if n < 1:
            raise IparError(f"{head!r}: the warm-up needs a positive number of steps, e.g. "
                            "warmup:100")
        return WarmupLR(n, one(rest, total_steps - n) if rest else None)
    return one(spec, total_steps)


class _Scheduled:
    """The learning rate of each step, from ``lr`` and ``schedule``."""

    def _check_clip(self):
        c = self.clip_norm
        if c is not None and (not isinstance(c, (int, float)) or isinstance(c, bool)
                              or not c > 0 or c == float("inf")):
            raise IparError(f"{type(self).__name__} clip_norm must be a number > 0 (or None: "
                            f"no clipping), got {c!r}.")

    def _check_schedule(self):
        self._check_clip()
        if self.schedule is not None and not hasattr(self.schedule, "factor"):
            raise IparError(f"{type(self).__name__} schedule must be StepLR, CosineLR or "
                            f"WarmupLR, got {self.schedule!r}.")

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based)."""
        return self.lr if self.schedule is None else self.lr * self.schedule.factor(step)

    def at_step(self, step: int) -> "SGD":
        """This optimizer with the rate of step ``step`` and no schedule (what one step
        uses)."""
        if self.schedule is None:
            return self
        return dataclasses.replace(self, lr=self.lr_at(step), schedule=None)

    def settings(self) -> dict:
        """The hyperparameters as JSON values (stored in checkpoints, checked on resume)."""
        out = {"kind": self.name}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = repr(v) if f.name == "schedule" and v is not None else (
                list(v) if isinstance(v, tuple) else v)
        return out


@dataclass(frozen=True)
class SGD(_Scheduled):
    """Stochastic gradient descent with momentum and weight decay (PyTorch's rule).

    ``v <- momentum * v + g + weight_decay * W`` and ``W <- W - lr_s * v`` (with
    ``nesterov``: ``W <- W - lr_s * (g + momentum * v)``); weight decay does not apply
    to biases. With ``clip_norm`` the gradients are first scaled by ``min(1, clip_norm /
    (norm + 1e-6))``, ``norm`` their global 2-norm over every layer (one one-word
    all-reduce per step, :func:`dask_ipar.cost.model.grad_norm_phase`). ``lr_s = lr * schedule.factor(s)`` at step ``s`` (0-based), or ``lr``
    without a schedule (:class:`StepLR`, :class:`CosineLR`, :class:`WarmupLR`). The state
    is one momentum block per weight slice.
    """

    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    schedule: StepLR | CosineLR | WarmupLR | None = None
    nesterov: bool = False
    #: clip the gradients to this global norm first (``torch.nn.utils.clip_grad_norm_``)
    clip_norm: float | None = None

    name = "sgd"
    #: state blocks per weight slice, for the planner's memory
    state_slots = 1

    def __post_init__(self):
        for name, lo in (("lr", 0.0), ("momentum", 0.0), ("weight_decay", 0.0)):
            _check_number("SGD", name, getattr(self, name), lo)
        if self.momentum >= 1:
            raise IparError(f"SGD momentum must be < 1, got {self.momentum}.")
        if self.nesterov and self.momentum == 0:
            raise IparError("Nesterov momentum needs momentum > 0.")
        self._check_schedule()


@dataclass(frozen=True)
class Adam(_Scheduled):
    """Adam (Kingma & Ba 2015) as ``torch.optim.Adam``: L2 weight decay added to the
    gradient (not to biases). The state is the two moments of every weight slice, one
    ``(2, rows, cols)`` block beside it (:mod:`dask_ipar.kernels.adam`)."""

    lr: float = 1e-3
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    schedule: StepLR | CosineLR | WarmupLR | None = None
    clip_norm: float | None = None

    name = "adam"
    decoupled = False
    state_slots = 2

    def __post_init__(self):
        kind = type(self).__name__
        for name, lo in (("lr", 0.0), ("eps", 0.0), ("weight_decay", 0.0)):
            _check_number(kind, name, getattr(self, name), lo)
        b = tuple(self.betas) if isinstance(self.betas, (list, tuple)) else ()
        if len(b) != 2 or not all(isinstance(x, (int, float)) and 0 <= x < 1 for x in b):
            raise IparError(f"{kind} betas must be two numbers in [0, 1), got {self.betas!r}.")
        object.__setattr__(self, "betas", (float(b[0]), float(b[1])))
        self._check_schedule()

    @property
    def hp(self) -> tuple:
        """What the kernels take: ``(beta1, beta2, eps, weight_decay, decoupled)``."""
        return (*self.betas, self.eps, self.weight_decay, self.decoupled)


@dataclass(frozen=True)
class AdamW(Adam):
    """AdamW (Loshchilov & Hutter 2019) as ``torch.optim.AdamW``: the weights (not the
    biases) shrink by ``1 - lr * weight_decay`` before the Adam step."""

    weight_decay: float = 1e-2

    name = "adamw"
    decoupled = True


def make_optimizer(kind: str, *, lr, momentum=0.9, weight_decay=0.0, schedule=None,
                   nesterov=False, clip_norm=None):
    """The optimizer of ``--optimizer KIND`` (``sgd``, ``adam`` or ``adamw``)."""
    if kind == "sgd":
        return SGD(lr, momentum, weight_decay, schedule, nesterov, clip_norm)
    if kind in ("adam", "adamw"):
        return (Adam if kind == "adam" else AdamW)(lr=lr, weight_decay=weight_decay,
                                                  schedule=schedule, clip_norm=clip_norm)
    raise IparError(f"unknown optimizer {kind!r}; expected sgd, adam or adamw.")
