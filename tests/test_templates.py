"""Step templates (:mod:`dask_ipar.runtime.templates`): submissions replayed from programs
compiled once compute the same floats as submissions built afresh, on every grid, and
are used where they apply (and only there)."""

from __future__ import annotations

import time

import dask
import numpy as np
import pytest

from dask_ipar import SGD, Adam, AdamW, Dense, Sequential
from dask_ipar.optim import StepLR
from dask_ipar.runtime import templates as T
from dask_ipar.runtime.replay import Rekey, template_uid


class _Count:
    """Counts template builds and replays (``T._build``, ``T._replay``) while active."""

    def __init__(self):
        self.built = self.replayed = self.refused = 0

    def __enter__(self):
        self._build, self._replay = T._build, T._replay

        def build(*a):
            self.built += 1
            return self._build(*a)

        def replay(*a):
            out = self._replay(*a)
            if out is None:
                self.refused += 1
            else:
                self.replayed += 1
            return out

        T._build, T._replay = build, replay
        return self

    def __exit__(self, *exc):
        T._build, T._replay = self._build, self._replay


def _fit(client, grid, k, optimizer, templates, epochs=3, lineage_steps=None, inflight=2):
    rng = np.random.default_rng(11)
    X = rng.standard_normal((6 * 10 + 4, 15))  # 6 steps an epoch, the last one 14 samples
    y = rng.integers(0, 5, X.shape[0])
    model = Sequential([Dense(12, "relu"), Dense(9, "tanh"), Dense(5)], input_dim=15,
                       dtype="float64", seed=4).distribute(client, grid)
    if lineage_steps is not None:
        model.lineage_steps = lineage_steps
    try:
        with dask.config.set({"dask-ipar.program-templates": templates}), _Count() as n:
            h = model.fit(X, y, epochs=epochs, batch_size=10, optimizer=optimizer,
                          steps_per_program=k, max_inflight=inflight)
        n.cuts = model._cuts
        return model.get_weights(), [s.loss for s in h.steps], n
    finally:
        model.close()


@pytest.mark.parametrize("grid,k,optimizer,cut", [
    ("2x2", 1, SGD(lr=0.1, momentum=0.9, weight_decay=0.01), None),
    ("2x2", 3, SGD(lr=0.1, momentum=0.9, schedule=StepLR(9, 0.5)), 5),
    ("3x1", 2, SGD(lr=0.05, momentum=0.9, nesterov=True, clip_norm=0.5), None),
    ("1x3", 4, SGD(lr=0.05), None),
    # Adam's update count comes with each replay (a block per cell and step)
    ("2x2", 2, Adam(lr=0.01), None),
    ("3x1", 3, AdamW(lr=0.01, weight_decay=0.05, clip_norm=0.5), 5),
    ("1x3", 1, Adam(lr=0.02), None),
])
def test_replayed_templates_equal_fresh_graphs_bit_for_bit(client, grid, k, optimizer, cut):
    w0, loss0, off = _fit(client, grid, k, optimizer, False, lineage_steps=cut)
    w1, loss1, on = _fit(client, grid, k, optimizer, True, lineage_steps=cut)
    assert off.built == off.replayed == 0
    assert on.replayed > on.built >= 1 and on.refused == 0
    assert loss1 == loss0 and len(loss0) == 3 * 6
    for (a, b), (c, d) in zip(w0, w1):
        assert np.array_equal(a, c) and np.array_equal(b, d)


def test_a_lineage_cut_replays_the_template_of_an_epochs_start(client, monkeypatch):
    """After a lineage cut the state has new names, but the template of the same layout
    replays: a template maps the state's names one by one, whatever they are. 6 steps an
    epoch, 3 a submission, a cut due after 8 steps: it comes at the first epoch's start
    that finds it due (step 13), where the weights are where they are at every epoch's
    start; so two templates serve all four epochs (an epoch's first submission, its
    second)."""
    from dask_ipar.runtime.state import BlockStore

    cut, at = BlockStore.cut_lineage, []
    monkeypatch.setattr(BlockStore, "cut_lineage",
                        lambda self, step: (at.append(step), cut(self, step))[1])
    opt = SGD(lr=0.1, momentum=0.9)
    w0, loss0, off = _fit(client, "2x2", 3, opt, False, epochs=4, lineage_steps=8, inflight=0)
    w1, loss1, on = _fit(client, "2x2", 3, opt, True, epochs=4, lineage_steps=8, inflight=0)
    # before step 13 (the state settled at the epoch's end), not forced before step 19
    assert on.cuts == off.cuts == 1 and at == [13, 13]
    # every submission but the first (it makes the momentum) from a template, two built
    assert on.built == 2 and on.replayed == 8 - 1 and on.refused == 0
    assert loss1 == loss0
    for (a, b), (c, d) in zip(w0, w1):
        assert np.array_equal(a, c) and np.array_equal(b, d)


def test_templates_are_not_used_for_batches_scattered_to_the_workers(client):
    rng = np.random.default_rng(1)
    X, y = rng.standard_normal((40, 15)), rng.integers(0, 5, 40)
    model = Sequential([Dense(5)], input_dim=15, seed=1).distribute(client, "2x2")
    model.embed_bytes = 0  # every batch scattered
    try:
        with _Count() as n:
            model.fit(X, y, epochs=2, batch_size=10, optimizer=SGD(lr=0.1),
                      steps_per_program=2)
    finally:
        model.close()
    assert n.built == n.replayed == 0


def test_rekey_renames_template_keys_only():
    rk = Rekey(template_uid("0a1b"), "0a1b", 40, {"dense0.v-0a1bT-s0": "dense0.v-0a1b-c2"})
    assert rk.key(("dense1.act-0a1bT-s3", 1, 0)) == ("dense1.act-0a1b-s43", 1, 0)
    assert rk.key(("dense0.w-0a1bT-s0", 0, 0)) == ("dense0.w-0a1b-s40", 0, 0)
    # a state name given one by one (the momentum, a lineage cut's blocks) wins
    assert rk.key(("dense0.v-0a1bT-s0", 0, 1)) == ("dense0.v-0a1b-c2", 0, 1)
    for same in [("dense0.v-0a1b-s1", 0, 0), ("step.run0-0a1b-s41", 2), "x", 3]:
        assert rk.key(same) == same
    assert rk.name("input.x-0a1bT-s12") == "input.x-0a1b-s52"


def test_replayed_programs_show_the_models_keys_in_the_task_stream(client):
    """The dashboard's bars of a replayed program name the model's uid and the real steps,
    not the template's."""
    from distributed import get_task_stream

    from dask_ipar.dashboard.timeline import uid_of_name
    from dask_ipar.testing import wait_for_program_bars

    rng = np.random.default_rng(2)
    X, y = rng.standard_normal((80, 15)), rng.integers(0, 5, 80)
    model = Sequential([Dense(8, "relu"), Dense(5)], input_dim=15, seed=2)
    model.distribute(client, "2x2")
    try:
        start = time.time()
        with get_task_stream(client) as ts, _Count() as n:
            model.fit(X, y, epochs=2, batch_size=10, optimizer=SGD(lr=0.1, momentum=0.9),
                      steps_per_program=2)
            wait_for_program_bars(client, start=start)
    finally:
        model.close()
    assert n.replayed >= 4
    names = [e["key"] for e in ts.data if isinstance(e["key"], str) and e["key"].startswith("dense")]
    assert names and {uid_of_name(k.removesuffix("-wait")) for k in names} == {model.uid}
    steps = {int(k.removesuffix("-wait").rpartition("-s")[2]) for k in names}
    assert len(steps & set(range(1, 17))) > 8  # the real steps (a template's are 0 to 2)


def test_a_template_whose_state_is_elsewhere_is_not_replayed(client):
    """``_replay`` submits nothing (and the caller builds the graph) when the model's state
    is not where the template expects it."""
    import dataclasses

    rng = np.random.default_rng(3)
    X, y = rng.standard_normal((40, 15)), rng.integers(0, 5, 40)
    model = Sequential([Dense(6, "relu"), Dense(5)], input_dim=15, seed=3)
    model.distribute(client, "2x2")
    try:
        model.fit(X, y, epochs=2, batch_size=10, optimizer=SGD(lr=0.1), steps_per_program=2)
        # one whose programs read the weights from the previous programs' results
        tpl = next(t for t in model._executor.templates.values()
                   if any(p.sources for p in t.progs))
        batches = [(X[:10], y[:10], SGD(lr=0.1))] * tpl.k
        step, w = model._step, list(model._w)
        renamed = dataclasses.replace(tpl, w0=[n + "x" for n in tpl.w0])
        assert T._replay(model, renamed, batches) is None
        model.get_weights()  # every block gets a task of its own: none is held now
        assert T._replay(model, tpl, batches) is None
        assert model._step == step and list(model._w) == w
    finally:
        model.close()
