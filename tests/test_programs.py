"""Worker programs (``Sequential.executor = "programs"``): the step graph run as one dask
task per worker equals the task-graph executor to the bit, moves the bytes the cost model
predicts, and fails fast and cleanly."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dask_ipar import SGD, Dense, Sequential
from dask_ipar.errors import IparError
from dask_ipar.runtime.exchange import PLUGIN_NAME
from dask_ipar.runtime.compiler import compile_programs
from dask_ipar.testing import awkward_problem, check_cnn, check_mlp


@pytest.mark.parametrize("grid", ["1x1", "1x3", "2x1", "2x2", "3x2"])
def test_programs_match_reference_and_cost_model(client, grid):
    errors = check_mlp(client, grid, steps=4, executor="programs")
    rows = errors["comm"].rows
    assert len(rows) == 3 * 4 - 1
    assert all(abs(r.ratio - 1) <= 1e-9 for r in rows)  # the sender logs exact sizes
    assert (sum(r.measured_bytes for r in rows) > 0) == (grid != "1x1")


@pytest.mark.parametrize("executor", ["programs", "graph"])
def test_cnn_matches_reference_with_either_executor(client, executor):
    errors = check_cnn(client, "2x2", executor=executor)
    assert all(abs(r.ratio - 1) <= 1e-9 for r in errors["comm"].rows)


def _train(client, grid, executor, steps=3, hidden=(29, 13)):
    X, y = awkward_problem((37, *hidden, 10), batch=23)
    model = Sequential([Dense(h, "relu") for h in hidden] + [Dense(10)], input_dim=37,
                       dtype="float64", seed=3)
    model.distribute(client, grid)
    model.executor = executor
    try:
        h = model.fit(X, y, epochs=steps, batch_size=23, shuffle=False,
                      optimizer=SGD(lr=0.1, momentum=0.9, weight_decay=0.01))
        return model.get_weights(), [s.loss for s in h.steps]
    finally:
        model.close()


def test_programs_equal_graph_executor_bit_for_bit(client):
    """Same kernels, same arguments, same order of every sum: identical floats."""
    w_graph, loss_graph = _train(client, "2x2", "graph")
    w_prog, loss_prog = _train(client, "2x2", "programs")
    assert loss_graph == loss_prog
    for (a, b), (c, d) in zip(w_graph, w_prog):
        assert np.array_equal(a, c) and np.array_equal(b, d)


def test_compiled_graph_has_one_task_per_worker_and_output(client):
    model = Sequential([Dense(16, "relu"), Dense(16, "relu"), Dense(10)], input_dim=12,
                       seed=0).distribute(client, "2x2")
    try:
        model.executor = "programs"
        rng = np.random.default_rng(0)
        model.train_step(rng.standard_normal((8, 12)).astype("float32"),
                         rng.integers(0, 10, 8), SGD())
        from dask_ipar.model import StepGraph

        g = StepGraph()
        x, y, _ = model._place_batch(rng.standard_normal((8, 12)).astype("float32"),
                                     rng.integers(0, 10, 8), 99, g)
        g, new_w, _, stats = model.engine.train_step(x, y, 8, model._w, model._v, 99, 0.1,
                                                     0.9, 0.0, g=g)
        outputs = [(n, i, j) for n in new_w for i, j in model.grid.cells()] + stats
        hlg, progs, orphans, _, _ = compile_programs(g, outputs, model._locate, "t", "x-s99")
        assert orphans == []
        dsk = dict(hlg)
        assert len(progs) == 4
        assert len(dsk) == 4 + len(outputs) < len(g.dsk)
        # a program depends only on blocks its own worker holds: nothing moves through dask
        place = {k: v for k, v in zip(progs, sorted(model.binding.workers))}
        for p in progs:
            for d in dsk[p].dependencies:
                assert model._locate(d) == place[p]
        # one program per worker and phase: the loss statistics come from the first
        hlg, progs, _, _, _ = compile_programs(g, outputs, model._locate, "t", "x-s99", first=stats)
        dsk = dict(hlg)
        assert sorted(k[0].split("-")[0] for k in progs) == ["step.run0"] * 4 + ["step.run1"] * 4
        assert len(dsk) == 8 + len(outputs)
        for k in stats:
            assert {d[0].split("-")[0] for d in dsk[k].dependencies} == {"step.run0"}
        for k in outputs[:-len(stats)]:  # new weights: the update is in the second
            assert {d[0].split("-")[0] for d in dsk[k].dependencies} == {"step.run1"}
        for p in progs:
            if p[0].startswith("step.run1"):  # reads only what the first left on its worker
                assert {d[0].split("-")[0] for d in dsk[p].dependencies} == {"step.run0"}
    finally:
        model.close()


def _boom(*args, **kwargs):
    raise ValueError("kernel failed on purpose")


def _patch_kernel(name, fn, dask_worker=None):
    import dask_ipar.kernels.dense as K

    setattr(K, "_saved_" + name, getattr(K, name))
    setattr(K, name, fn)


def _unpatch_kernel(name, dask_worker=None):
    import dask_ipar.kernels.dense as K

    setattr(K, name, getattr(K, "_saved_" + name))


def _mailbox(dask_worker=None):
    p = dask_worker.plugins[PLUGIN_NAME]
    return sorted(map(str, p.box))


def _small_model(client, grid, timeout_s):
    """A float32 16-10 MLP run as programs on ``grid``, and a batch of 8."""
    model = Sequential([Dense(16, "relu"), Dense(10)], input_dim=12, seed=0)
    model.distribute(client, grid)
    model.executor = "programs"
    model.program_timeout_s = timeout_s
    rng = np.random.default_rng(0)
    return model, rng.standard_normal((8, 12)).astype("float32"), rng.integers(0, 10, 8)


def _weight_futures(model):
    from distributed import wait

    futs = [model._futures[(n, *c)] for n in model._w for c in model.grid.cells()]
    wait(futs, timeout=60)
    return futs


def test_failing_program_stops_its_peers_at_once(client):
    """A kernel that raises on one worker fails the step on every worker within seconds
    (not after the timeout), with the error named, and leaves the workers usable."""
    model, X, y = _small_model(client, "2x2", 120.0)
    victim = model.binding.worker(1, 1)
    try:
        client.gather(model.train_step(X, y, SGD()))  # the first step creates the momentum
        # the kernels run on the workers by reference to their module: patch one worker's
        client.run(_patch_kernel, "dense_forward", _boom, workers=[victim])
        t0 = time.perf_counter()
        stats = model.train_step(X, y, SGD())
        with pytest.raises(Exception, match="kernel failed on purpose|stopped"):
            model._store.gather_step(stats, model._step)
        futs = _weight_futures(model)
        elapsed = time.perf_counter() - t0
        assert elapsed < 30, elapsed  # not the 120 s timeout: the victim told its peers
        # every cell needs the victim's activations or blocks computed from them
        assert all(f.status == "error" for f in futs)
        errors = [str(f.exception()) for f in futs]
        assert any("kernel failed on purpose" in e for e in errors)
        assert any("stopped on worker" in e and "kernel failed on purpose" in e
                   for e in errors)
    finally:
        client.run(_unpatch_kernel, "dense_forward", workers=[victim])
        model.close()
    # every worker's thread is free again and no block is left in a mailbox
    assert client.submit(sum, [1, 2], workers=[victim], pure=False).result(timeout=30) == 3
    # (a block pushed just before the abort may still be on its way under load: it is
    # dropped on arrival, so poll for a while rather than once)
    deadline = time.monotonic() + 10
    while True:
        left = client.run(_mailbox, workers=list(model.binding.workers))
        if not any(left.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert not any(left.values()), left


def _slow(*args, **kwargs):
    time.sleep(2.5)
    import dask_ipar.kernels.dense as K

    return K._saved_dw_piece(*args, **kwargs)


def test_waiting_program_times_out_with_a_clear_error(client):
    model, X, y = _small_model(client, "1x2", 1.0)
    slow = model.binding.worker(0, 0)
    client.run(_patch_kernel, "dw_piece", _slow, workers=[slow])
    try:
        model.train_step(X, y, SGD())
        # the loss statistics come from the first program (forward and loss); the slow
        # kernel is in the second, whose peer gives up waiting for its dW piece
        futs = _weight_futures(model)
        errors = " ".join(str(f.exception()) for f in futs if f.status == "error")
        assert "waited 1 s without receiving a block" in errors
    finally:
        client.run(_unpatch_kernel, "dw_piece", workers=[slow])
        model.close()
    # the slow worker's thread finishes its program (sending its late pieces, which are
    # dropped on arrival): then no mailbox holds anything
    assert client.submit(sum, [1, 2], workers=[slow], pure=False).result(timeout=30) == 3
    time.sleep(0.5)
    assert not any(client.run(_mailbox, workers=list(model.binding.workers)).values())


def _plugin_id(dask_worker=None):
    return id(dask_worker.plugins[PLUGIN_NAME])


def test_a_second_registration_keeps_the_mailboxes(client):
    """Every model registers the plugin; a registration must not replace (tear down) the
    one whose mailbox another model's running programs use."""
    from dask_ipar.runtime.exchange import install_exchange

    install_exchange(client)
    before = client.run(_plugin_id)
    install_exchange(client)
    assert client.run(_plugin_id) == before


def test_unknown_executor_is_a_clear_error(client):
    model = Sequential([Dense(10)], input_dim=4).distribute(client, "1x1")
    model.executor = "fused"
    try:
        with pytest.raises(IparError, match="executor is 'fused', expected 'graph' or "
                                            "'programs'"):
            model.train_step(np.zeros((2, 4), "float32"), np.zeros(2, int), SGD())
    finally:
        model.close()


def test_blocks_of_a_stopped_model_are_dropped_on_arrival():
    """After the whole model's programs are stopped (a grid worker left, the model closed),
    blocks of its steps and cuts up to then that are still on their way are dropped; those
    of later steps (the same model, restarted from a checkpoint) are kept."""
    from types import SimpleNamespace

    from dask_ipar.runtime.exchange import ExchangePlugin

    plugin = ExchangePlugin()
    plugin.setup(SimpleNamespace(handlers={}, address="inproc://test/1"))
    plugin.put(key=["dense0.act-abc-s4", 0, 1], data=b"x")
    plugin.abort(tag="abc", reason="the model was closed", model=True, upto=(5, 2))
    assert plugin.box == {}
    for name in ("dense0.w-abc-s5", "dense1.dwp-abc-s3", "dense0.w-abc-c2"):
        plugin.put(key=[name, 0, 1], data=b"late")
    assert plugin.box == {}
    plugin.put(key=["dense0.w-abc-s6", 0, 1], data=b"new")
    plugin.put(key=["dense0.w-abc-c3", 0, 1], data=b"new")
    plugin.put(key=["dense0.w-xyz-s1", 0, 1], data=b"other model")
    assert sorted(k[0] for k in plugin.box) == ["dense0.w-abc-c3", "dense0.w-abc-s6",
                                                "dense0.w-xyz-s1"]


def _exchange_log(dask_worker=None):
    from dask_ipar.runtime.exchange import drain_exchange_log

    return [[len(e[3]), max(nb for _, nb in e[3])] for e in drain_exchange_log(
        dask_worker=dask_worker)]


def test_small_blocks_to_one_peer_go_as_one_message(client):
    """Blocks under MERGE_BYTES that a program sends to one peer without computing in
    between (its weight slices at the start of a step) travel as one message; the step
    stays bit-equal to the task graph's (the test above) and the bytes exact (the first)."""
    from dask_ipar.runtime.exchange import MERGE_BYTES

    X, y = awkward_problem((37, 29, 13, 10), batch=23)
    model = Sequential([Dense(29, "relu"), Dense(13, "relu"), Dense(10)], input_dim=37,
                       dtype="float64", seed=3).distribute(client, "2x2")
    model.executor = "programs"
    try:
        model.state_blocks()
        client.run(_exchange_log)
        client.gather(model.train_step(X, y, SGD(lr=0.1)))
        msgs = [m for log in client.run(_exchange_log).values() for m in log]
    finally:
        model.close()
    merged = [m for m in msgs if m[0] > 1]
    assert merged, msgs
    assert all(biggest < MERGE_BYTES for _, biggest in merged)
    assert len(msgs) < sum(n for n, _ in msgs)


def test_programs_on_threads_equal_the_graph_executor():
    """Worker threads of one process (in-process comms, where dask hands messages over
    without serializing them): merged small blocks arrive as the blocks themselves."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=4, processes=False, threads_per_worker=1,
                      dashboard_address=None) as cluster, Client(cluster) as c:
        w_graph, loss_graph = _train(c, "2x2", "graph")
        w_prog, loss_prog = _train(c, "2x2", "programs")
    assert loss_graph == loss_prog
    for (a, b), (d, e) in zip(w_graph, w_prog):
        assert np.array_equal(a, d) and np.array_equal(b, e)


def test_dask_fine_performance_metrics_split_programs_by_layer_and_phase(client):
    """Dask's "Fine Performance Metrics" of the program tasks: seconds per layer and
    phase, and the waits for blocks (what the dashboard page shows)."""
    rng = np.random.default_rng(0)
    model = Sequential([Dense(8, "relu"), Dense(3)], input_dim=5).distribute(client, "2x2")
    try:
        model.fit(rng.standard_normal((64, 5)), rng.integers(0, 3, 64), batch_size=16)
    finally:
        model.close()

    def labels(dask_scheduler):
        return [k for k in dask_scheduler.cumulative_worker_metrics
                if isinstance(k, tuple) and len(k) == 4 and str(k[1]).startswith("step.run")
                and k[3] == "seconds"]

    deadline = time.monotonic() + 10  # workers send their metrics with the heartbeat
    while True:
        seen = {k[2] for k in client.run_on_scheduler(labels)}
        want = {"dense0 forward", "dense1 forward", "loss loss", "dense1 dw_reduce",
                "dense0 update", "wait for blocks"}
        if want <= seen or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert want <= seen, sorted(seen)


def test_kernel_cpu_counts_each_kernel_call_of_the_programs(client):
    """``programs.kernel_cpu``: off by default; switched on, each worker counts its
    programs' kernel calls by task and function (the forward's, one per cell and step) and
    their CPU time; switched off, it returns the counts and stops. With ``system``, also
    each kernel's system time (``kernel_system_cpu``), None again once switched off."""
    from dask_ipar.runtime.programs import kernel_cpu, kernel_system_cpu

    model, X, y = _small_model(client, "2x1", 60.0)
    try:
        assert set(client.run(kernel_cpu).values()) == {None}
        workers = [model.binding.worker(i, 0) for i in range(2)]
        client.run(kernel_cpu, True, workers=workers)
        opt = SGD(lr=0.1)
        for _ in range(2):
            client.gather(model.train_step(X, y, opt))
        _weight_futures(model)
        got = client.run(kernel_cpu, False, workers=workers)
        for counts in got.values():
            forward = {k: v for k, v in counts.items() if k.startswith("act:dense_forward")}
            assert sum(n for _, n in forward.values()) == 2 * 2  # two layers, two steps
            assert all(sec >= 0.0 for sec, _ in counts.values())
            assert sum(sec for sec, _ in counts.values()) > 0.0
        assert set(client.run(kernel_cpu, workers=workers).values()) == {None}
        # with system=True, each kernel's time in the OS kernel too, under the same names
        assert set(client.run(kernel_system_cpu, workers=workers).values()) == {None}
        client.run(kernel_cpu, True, True, workers=workers)
        client.gather(model.train_step(X, y, opt))
        _weight_futures(model)
        system = client.run(kernel_system_cpu, workers=workers)
        got = client.run(kernel_cpu, False, workers=workers)
        for w, counts in got.items():
            kernels = {k for k in counts if not k.startswith("program:")}
            assert set(system[w]) == kernels and "act:dense_forward" in " ".join(kernels)
            assert all(0.0 <= s <= 10.0 for s in system[w].values())
        assert set(client.run(kernel_system_cpu, workers=workers).values()) == {None}
    finally:
        model.close()
