"""Optimizer settings and learning-rate schedules. The optimizer's state (momentum) lives
on the workers beside the weight slices; the learning rate of each step is a pure
function of the step (:meth:`SGD.at_step`), so a resumed run uses the rates an
uninterrupted one does."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from dask_ipar.errors import IparError

__all__ = ["SGD", "StepLR", "CosineLR", "WarmupLR", "parse_schedule"]


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


@dataclass(frozen=True)
class SGD:
    """Stochastic gradient descent with momentum and weight decay (PyTorch's rule).

    ``v <- momentum * v + g + weight_decay * W`` and ``W <- W - lr_s * v``; weight
    decay does not apply to biases. ``lr_s = lr * schedule.factor(s)`` at step ``s``
    (0-based), or ``lr`` without a schedule (:class:`StepLR`, :class:`CosineLR`,
    :class:`WarmupLR`).
    """

    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    schedule: StepLR | CosineLR | WarmupLR | None = None

    def __post_init__(self):
        for name, lo in (("lr", 0.0), ("momentum", 0.0), ("weight_decay", 0.0)):
            _check_number("SGD", name, getattr(self, name), lo)
        if self.momentum >= 1:
            raise IparError(f"SGD momentum must be < 1, got {self.momentum}.")
        if self.schedule is not None and not hasattr(self.schedule, "factor"):
            raise IparError(f"SGD schedule must be StepLR, CosineLR or WarmupLR, got "
                            f"{self.schedule!r}.")

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
        out = {"kind": "sgd", "lr": self.lr, "momentum": self.momentum,
               "weight_decay": self.weight_decay}
        if self.schedule is not None:
            out["schedule"] = repr(self.schedule)
        return out
