"""The step-time simulator on small task graphs with hand-computed answers, and on a real step."""

from __future__ import annotations

import numpy as np
import pytest

from dask_ipar.cost import Machine, SimTask, simulate_step
from dask_ipar.errors import IparError
from dask_ipar.optim import SGD


def test_chain_across_two_workers():
    # a (A) -> b (B) -> c (A): 3 hops, 2 transfers of 1 MB at 1 MB/s, 1 s of compute each
    tasks = [
        SimTask("a", "A", (), flops=1e9, out_bytes=1e6),
        SimTask("b", "B", ("a",), flops=1e9, out_bytes=1e6),
        SimTask("c", "A", ("b",), flops=1e9, out_bytes=8),
    ]
    r = simulate_step(tasks, flops_per_s=1e9, bandwidth_Bps=1e6, hop_s=0.01, latency_s=0.5)
    assert r.seconds == pytest.approx(3 * 0.01 + 3 * 1.0 + 2 * (0.5 + 1.0))
    assert r.critical_hops == 3 and r.transfer_bytes == 2e6


def test_one_worker_runs_one_task_at_a_time_and_cores_are_shared():
    tasks = [SimTask(k, "A", (), flops=1e9) for k in "xyz"] + [SimTask("w", "B", (), flops=1e9)]
    r = simulate_step(tasks, flops_per_s=1e9, bandwidth_Bps=1e9, hop_s=0.0)
    assert r.seconds == pytest.approx(3.0)  # x, y, z in sequence on A; w alongside on B
    shared = simulate_step(tasks, flops_per_s=1e9, bandwidth_Bps=1e9, hop_s=0.0, cores=1)
    assert shared.seconds == pytest.approx(6.0)  # two workers on one core: half speed each


def test_inputs_in_place_cost_a_transfer_only_off_their_worker():
    tasks = [SimTask("t", "A", ("w_remote", "w_local"), flops=0)]
    r = simulate_step(tasks, flops_per_s=1, bandwidth_Bps=100.0, hop_s=0.0,
                      available={"w_remote": ("B", 200), "w_local": ("A", 10**9)})
    assert r.seconds == pytest.approx(2.0) and r.transfer_bytes == 200


def test_predicted_step_of_a_real_grid(client):
    """The engine's own graph goes through the simulator: more rows, less weight traffic."""
    from dask_ipar import Dense, Sequential

    m = Machine(alpha_s=0.005, bandwidth_Bps=1e8, word_bytes=4, flops_per_s=1e10)
    out = {}
    for grid in ("1x4", "4x1"):
        model = Sequential([Dense(512, "relu"), Dense(10)], input_dim=512).distribute(client, grid)
        out[grid] = model.predict_step_s(32, m)
        model.close()
    # weight-dominated at B = 32: pure batch moves the 512x513 weights twice per step
    assert out["1x4"].transfer_bytes > out["4x1"].transfer_bytes
    assert out["1x4"].seconds > out["4x1"].seconds > 0


def test_throughput_view_adds_the_work_on_shared_cores_once():
    """Hand-computed: two independent tasks on two workers, each 1 GFLOP and 1 GB of
    elementwise work; one sends 0.5 GB to a third task."""
    tasks = [SimTask("a", "A", (), flops=1e9, mem_bytes=1e9, out_bytes=5e8),
             SimTask("b", "B", (), flops=1e9, mem_bytes=1e9),
             SimTask("c", "B", ("a",), flops=0.0)]
    kw = dict(flops_per_s=1e9, bandwidth_Bps=1e9, hop_s=0.0, mem_Bps=1e9)
    alone = simulate_step(tasks, **kw)
    assert alone.seconds == pytest.approx(2.5)  # a (2 s), then 0.5 s transfer, c
    both = simulate_step(tasks, **kw, task_s=0.1, cluster_flops_per_s=4e9,
                         cluster_mem_Bps=2e9, cluster_bandwidth_Bps=2e9)
    # 3 tasks * 0.1 + 2 GFLOP / 4 + 2 GB / 2 + 0.5 GB / 2
    assert both.throughput_s == pytest.approx(0.3 + 0.5 + 1.0 + 0.25)
    assert both.latency_s == pytest.approx(2.5)
    assert both.critical_compute_s == pytest.approx(2.0)  # a's work is on the critical path
    assert both.seconds == pytest.approx(2.5 + 2.05 - 2.0)


def _nets():
    from dask_ipar import Conv2d, Dense, Flatten, MaxPool2d
    from dask_ipar.testing import awkward_cnn

    def cnn(parallel):
        return ([Conv2d(8, 3, padding=1, activation="relu", parallel=parallel), MaxPool2d(2),
                 Conv2d(8, 3, padding=1, activation="relu", parallel=parallel), MaxPool2d(2),
                 Flatten(), Dense(16, "relu"), Dense(5)], (3, 16, 16))

    return {
        "mlp": ([Dense(13, "relu"), Dense(11, "tanh"), Dense(5)], (29,)),
        "awkward-cnn": awkward_cnn(),
        "batch-cnn": cnn("batch"),
        "domain-cnn": cnn("domain"),
        "model-cnn": cnn("model"),
    }


@pytest.mark.fast
@pytest.mark.parametrize("net", ["mlp", "awkward-cnn", "batch-cnn", "domain-cnn", "model-cnn"])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_simulated_step_moves_what_the_comm_table_predicts(net, opt):
    """Dense networks and CNNs (batch-, domain- and model-parallel convs) on every grid of
    up to 8 processes the engine runs: the bytes the simulated step transfers between
    workers equal the comm table's prediction (which the cluster tests check against the
    bytes dask moves); and the simulated flops of the conv and dense layers are the
    layers' own (2 multiply-adds per MAC forward, 4 backward, less the first layer's
    input gradient)."""
    from dask_ipar import SGD, Adam, Sequential
    from dask_ipar.cost import LOOPBACK_MACHINE
    from dask_ipar.layout.grid import factorizations
    from dask_ipar.nn.planning import cost_specs
    from dask_ipar.runtime.meter import predict_step
    from dask_ipar.runtime.stepmodel import step_tasks
    from dask_ipar.testing import fake_binding

    layers, shape = _nets()[net]
    batch = 16
    optimizer = SGD(0.1, momentum=0.9) if opt == "sgd" else Adam(0.01)
    if len(shape) == 3:
        model = Sequential(layers, input_shape=shape)
        specs = cost_specs(layers, shape)
    else:
        model = Sequential(layers, input_dim=shape[0])
        specs = None
    checked = 0
    for p in (1, 2, 3, 4, 6, 8):
        for grid in factorizations(p):
            try:
                engine = model._make_engine(fake_binding(grid))
            except (IparError, ValueError):
                continue  # the engine refuses this grid (a strip without rows, ...)
            tasks, available = step_tasks(engine, [f"w{k}" for k in range(len(engine.param_layouts))],
                                          batch, shape, "float64", optimizer)
            r = simulate_step(tasks, flops_per_s=1e10, bandwidth_Bps=1e9, hop_s=1e-3,
                              available=available)
            meter = sum(ph.total_bytes for ph in predict_step(engine, grid.pr, grid.pc, batch,
                                                              LOOPBACK_MACHINE, 8))
            assert r.transfer_bytes == meter, (net, grid)
            if specs is not None:
                conv = sum(t.flops for t in tasks if "conv" in str(t.key[0]).split(".")[0]
                           and any(f".{task}-" in t.key[0]
                                   for task in ("act", "inner", "bwd", "dxedge")))
                macs = [s.macs * batch for s in specs if type(s).__name__ == "Conv2d"]
                # forward 2 flops per MAC, backward dW 2 and dx 2 (none for the first conv)
                assert conv == pytest.approx(6 * sum(macs) - 2 * macs[0]), (net, grid)
            checked += 1
    assert checked >= 8


@pytest.mark.fast
def test_programs_push_blocks_over_links_the_flows_share_fairly():
    """Hand-computed: a (A, 1 s, 1 MB out) read by b (B) and c (C): both blocks leave at
    once and share A's link (0.5 MB/s each for 2 s), each arrives 0.5 s after its last
    byte left; b and c take 1 s each."""
    from dask_ipar.cost import simulate_programs

    tasks = [SimTask("a", "A", (), flops=1e9, out_bytes=1e6),
             SimTask("b", "B", ("a",), flops=1e9), SimTask("c", "C", ("a",), flops=1e9)]
    kw = dict(flops_per_s=1e9, mem_Bps=1e9, bandwidth_Bps=1e6, latency_s=0.5)
    trace = []
    r = simulate_programs(tasks, **kw, trace=trace)
    assert r.seconds == pytest.approx(4.5) and r.transfer_bytes == 2e6
    assert {k: (s, e) for _, k, s, e in trace} == {
        "a": (0, 1), "b": pytest.approx((3.5, 4.5)), "c": pytest.approx((3.5, 4.5))}
    # a receiver's link is limited too: three senders pushing 1 MB each to one reader at
    # once share its 1 MB/s (3 s), where links limited only on the way out would take 1 s
    many = [SimTask(f"s{k}", f"S{k}", (), out_bytes=1e6) for k in range(3)]
    r = simulate_programs([*many, SimTask("sum", "R", ("s0", "s1", "s2"))], **kw)
    assert r.seconds == pytest.approx(3.5)
    # a block of a second sender to another reader is not slowed by the first's flows:
    # it takes that reader's whole link
    r = simulate_programs([*many, SimTask("sum", "R", ("s0", "s1")),
                           SimTask("own", "Q", ("s2",))], **kw, trace=trace)
    assert r.seconds == pytest.approx(2.5)


@pytest.mark.fast
def test_a_small_block_waits_behind_the_blocks_its_links_carry():
    """``loaded_latency_s``: a block that leaves while its sender's or its reader's link
    carries other blocks arrives that long after its last byte (the links' queues), others
    after ``latency_s``. A 4 MB block A -> B takes 4 s at 1 MB/s; a 4-byte block A -> C
    made at 1 s arrives 0.5 s later (A's link is busy), one D -> C at 1 s after 0.01 s."""
    from dask_ipar.cost import simulate_programs

    tasks = [SimTask("big", "A", (), out_bytes=4e6), SimTask("x", "A", (), flops=1e9,
                                                              out_bytes=4),
             SimTask("y", "D", (), flops=1e9, out_bytes=4),
             SimTask("b", "B", ("big",)), SimTask("c", "C", ("x",)), SimTask("e", "C", ("y",))]
    kw = dict(flops_per_s=1e9, mem_Bps=1e9, bandwidth_Bps=1e6, latency_s=0.01)
    ends = {}
    for loaded in (None, 0.5):
        trace = []
        simulate_programs(tasks, **kw, loaded_latency_s=loaded, trace=trace)
        ends[loaded] = {k: e for _, k, _, e in trace}
    assert ends[None]["c"] == pytest.approx(1.01, abs=1e-4)
    assert ends[0.5]["c"] == pytest.approx(1.5, abs=1e-4)
    assert ends[0.5]["e"] == pytest.approx(1.01, abs=1e-4) == ends[None]["e"]
    assert ends[0.5]["b"] == pytest.approx(4.01, abs=1e-3)


@pytest.mark.fast
def test_fair_rates_fill_the_links_max_min():
    """Progressive filling, hand-computed on links of 1 out of and 1 into each worker."""
    from dask_ipar.cost import fair_rates

    # two flows out of A and two into B: every link shares out 1/2
    assert fair_rates([("A", "B"), ("A", "C"), ("D", "B")], 1.0) == [0.5, 0.5, 0.5]
    # three flows into B get a third each; A's other flow takes what A's link has left
    assert fair_rates([("A", "B"), ("C", "B"), ("D", "B"), ("A", "E")], 1.0) \
        == pytest.approx([1 / 3, 1 / 3, 1 / 3, 2 / 3])
    # an all-to-all of 3 workers: each link carries 2 flows at half its rate
    pairs = [(a, b) for a in "XYZ" for b in "XYZ" if a != b]
    assert fair_rates(pairs, 6.0) == pytest.approx([3.0] * 6)
    assert fair_rates([], 1.0) == []


@pytest.mark.fast
def test_links_carry_their_busy_rate_while_the_kernels_fill_the_cores():
    """``busy_bandwidth_Bps``: the links' rate while as many tasks run as there are cores
    (the transports wait for the cores), the full rate otherwise. A 1 MB block leaves A at
    0 while B runs a 2 s task on B's one core: 0.5 MB/s until 2 s (1 MB/s link, busy rate
    0.5 MB/s), then the block is done (1 MB in 2 s) and c runs at once."""
    from dask_ipar.cost import simulate_programs

    tasks = [SimTask("b", "B", (), flops=2e9), SimTask("c", "C", ("w",))]
    kw = dict(flops_per_s=1e9, mem_Bps=1e9, bandwidth_Bps=1e6, latency_s=0.0,
              available={"w": ("A", 1e6)})
    assert simulate_programs(tasks, **kw).seconds == pytest.approx(2.0)
    trace = []
    simulate_programs(tasks, **kw, cores=1, busy_bandwidth_Bps=0.5e6, trace=trace)
    assert dict((k, e) for _, k, _, e in trace)["c"] == pytest.approx(2.0)
    # a shorter task leaves the rest of the block to the full rate: 0.5 MB in the first
    # second, the other 0.5 MB in 0.5 s
    tasks[0] = SimTask("b", "B", (), flops=1e9)
    trace = []
    simulate_programs(tasks, **kw, cores=1, busy_bandwidth_Bps=0.5e6, trace=trace)
    assert dict((k, e) for _, k, _, e in trace)["c"] == pytest.approx(1.5)
    # without shared cores the busy rate does not apply
    trace = []
    simulate_programs(tasks, **kw, busy_bandwidth_Bps=0.5e6, trace=trace)
    assert dict((k, e) for _, k, _, e in trace)["c"] == pytest.approx(1.0)


@pytest.mark.fast
def test_programs_run_the_first_task_whose_blocks_are_in_and_share_the_cores():
    from dask_ipar.cost import simulate_programs

    # A's first task waits for y from B (1 s + 0.1 s latency); its second is local, so A
    # runs it meanwhile; on one core both workers run at half speed while both are busy
    tasks = [SimTask("y", "B", (), flops=1e9, out_bytes=8),
             SimTask("x", "A", ("y",), flops=1e9),
             SimTask("z", "A", (), flops=1e9)]
    kw = dict(flops_per_s=1e9, mem_Bps=1e9, bandwidth_Bps=1e12, latency_s=0.1)
    # z on A while y runs on B; y's block arrives at 1.1, then x
    assert simulate_programs(tasks, **kw).seconds == pytest.approx(2.1)
    # one core: z and y share it (2 s), y's block arrives at 2.1, x alone until 3.1
    assert simulate_programs(tasks, **kw, cores=1).seconds == pytest.approx(3.1)
    # two cores that lose three quarters of their speed to each other while both run: z
    # and y take 4 s; x runs alone at full speed
    assert simulate_programs(tasks, **kw, cores=2, shared=0.25).seconds == pytest.approx(5.1)
    # inputs in place: one on A read by B arrives after its bytes and the latency
    r = simulate_programs([SimTask("t", "B", ("w",), flops=0)], **kw, available={"w": ("A", 10)})
    assert r.seconds == pytest.approx(0.1) and r.transfer_bytes == 10


@pytest.mark.fast
def test_programs_charge_a_transfer_to_the_shared_cores_at_both_ends():
    from dask_ipar.cost import simulate_programs

    # a (1 s on A) makes a 1 MB block that b (1 s on B) reads; the link takes 1 s, and
    # moving it costs each end 1 s of CPU (1e-6 s per byte)
    tasks = [SimTask("a", "A", (), flops=1e9, out_bytes=1e6),
             SimTask("b", "B", ("a",), flops=1e9)]
    kw = dict(flops_per_s=1e9, mem_Bps=1e9, bandwidth_Bps=1e6, latency_s=0.0,
              transfer_cpu_s_per_B=1e-6)
    # a core per worker (cores not given): the transport is not charged; a 0-1, link
    # 1-2, b 2-3
    assert simulate_programs(tasks, **kw).seconds == pytest.approx(3.0)
    # one shared core: both ends' transport work (1 s each) from when the block starts on
    # the link at 1, at half speed each until it arrives at 2; then b and the rest share
    # the core (a third each) until the transport work is done at 3.5, b alone to 4
    assert simulate_programs(tasks, **kw, cores=1).seconds == pytest.approx(4.0)
    # two cores: the transport work runs beside the link, and b alone after it
    assert simulate_programs(tasks, **kw, cores=2).seconds == pytest.approx(3.0)
    # transport work that outlasts the link delays the step's end, even with nothing to
    # compute after it: 3 s at each end from 1, sharing one core
    one = [SimTask("a", "A", (), flops=1e9, out_bytes=1e6), SimTask("b", "B", ("a",))]
    assert simulate_programs(one, **{**kw, "transfer_cpu_s_per_B": 3e-6},
                             cores=1).seconds == pytest.approx(1 + 3 + 3)
    # two blocks in place on A share its link (both 0-2): each end's work for both starts
    # at 0; on one core all 4 s of transport work end at 4
    two = [SimTask("b", "B", ("x", "y"))]
    r = simulate_programs(two, **kw, cores=1, available={"x": ("A", 1e6), "y": ("A", 1e6)})
    assert r.seconds == pytest.approx(4.0) and r.transfer_bytes == 2e6
    # what the cores lose to each other (shared) applies to transport work beside a task
    # as to tasks: a 1 s task on A beside a block in place leaving it (1 s of work at each
    # end, the link 1 s) on 3 cores that run at a quarter speed while more than one runs
    r = simulate_programs([SimTask("z", "A", (), flops=1e9), SimTask("b", "B", ("x",))],
                          **kw, cores=3, shared=0.25, available={"x": ("A", 1e6)})
    assert r.seconds == pytest.approx(4.0)


def test_simulated_grids_without_a_cluster_match_the_distributed_model(client):
    """simulate_layers (placeholder workers) predicts what a distributed model's
    predict_step_s does, for both executors; rank_grids orders every grid by it."""
    from dask_ipar import Dense, Sequential
    from dask_ipar.runtime.gridrank import rank_grids, simulate_layers

    m = Machine(alpha_s=0.005, bandwidth_Bps=1e8, word_bytes=4, flops_per_s=1e10,
                cluster_flops_per_s=1.5e10, message_s=3e-4, round_s=0.01)
    layers = [Dense(512, "relu"), Dense(10)]
    model = Sequential(layers, input_dim=512).distribute(client, "2x2")
    try:
        for ex in ("programs", "graph"):
            want = model.predict_step_s(32, m, cores=2, executor=ex).seconds
            got = simulate_layers(layers, (512,), "2x2", 32, m, cores=2, executor=ex,
                                  optimizer=SGD()).seconds
            assert got == pytest.approx(want)
        # several steps per program share the submission's round trip and its last
        # step's push (programs only): k steps take A + (k - 1) M, A a submission of one
        # step (its round trip included), M a step within a program
        def per_step(k, mach=m):
            return model.predict_step_s(32, mach, cores=2, executor="programs",
                                        steps_per_program=k).seconds

        one, two, eight = per_step(1), per_step(2), per_step(8)
        within = 2 * two - one
        assert eight == pytest.approx((one + 7 * within) / 8)
        assert 0 < within < one
        assert one - per_step(1, m.replace(round_s=0.0)) == pytest.approx(m.round_s)
        assert model.predict_step_s(32, m, executor="graph", steps_per_program=8).seconds \
            == model.predict_step_s(32, m, executor="graph").seconds
    finally:
        model.close()
    # "auto": the steps a submission fit picks on the machine, simulated so (a model whose
    # step computes too long for the rule without a machine, 1, and a 0.2 s round trip)
    from dask_ipar.runtime.steps import auto_steps_per_program

    big, slow = [Dense(2048, "relu"), Dense(2048, "relu"), Dense(10)], m.replace(round_s=0.2)
    model = Sequential(big, input_dim=2048).distribute(client, "2x2")
    try:
        assert auto_steps_per_program(model, 512, SGD()) == 1
        k = auto_steps_per_program(model, 512, SGD(), slow, 2)
        assert 1 < k < 16, k
        want = model.predict_step_s(512, slow, cores=2, steps_per_program=k).seconds
    finally:
        model.close()
    assert simulate_layers(big, (2048,), "2x2", 512, slow, cores=2, optimizer=SGD(),
                           steps_per_program="auto").seconds == pytest.approx(want)
    (auto,) = rank_grids(big, (2048,), 4, 512, slow, cores=2, grids=["2x2"], optimizer=SGD(),
                         steps_per_program="auto")
    assert auto.steps_per_program == k and auto.seconds == pytest.approx(want)
    with pytest.raises(IparError, match="steps_per_program"):
        simulate_layers(big, (2048,), "2x2", 512, slow, steps_per_program=0)
    ranked = rank_grids(layers, (512,), 4, 32, m, cores=2)
    assert [str(c.grid) for c in ranked] == sorted((str(c.grid) for c in ranked),
                                                   key={str(c.grid): c.seconds for c in ranked}.get)
    assert {str(c.grid) for c in ranked} == {"1x4", "2x2", "4x1"}
    # weight-dominated at B = 32: splitting the weights beats replicating them
    assert str(ranked[0].grid) != "1x4"


@pytest.mark.fast
def test_rank_grids_picks_conv_schemes_the_engine_runs():
    """A CNN's candidates on each grid: the alpha-beta planner's schemes and each scheme
    for every conv; the engine refuses model-parallel convs with fewer filters than Pr
    (2 filters on 4x1), so that grid runs other schemes."""
    from dask_ipar import Conv2d, Dense, Flatten, MaxPool2d
    from dask_ipar.runtime.gridrank import rank_grids

    m = Machine(alpha_s=0.005, bandwidth_Bps=1e8, word_bytes=4, flops_per_s=1e10,
                message_s=3e-4)
    layers = [Conv2d(2, 3, padding=1, activation="relu"), MaxPool2d(2), Flatten(),
              Dense(16, "relu"), Dense(5)]
    ranked = rank_grids(layers, (3, 16, 16), 4, 8, m, cores=2)
    assert {str(c.grid) for c in ranked} == {"1x4", "2x2", "4x1"}
    for c in ranked:
        conv = c.layers[0]
        assert conv.parallel in ("batch", "domain", "model")
        if c.grid.pr == 4:
            assert conv.parallel != "model"
    assert all(a.seconds <= b.seconds for a, b in zip(ranked, ranked[1:]))
    # a machine whose dask background takes every core: said, not "no grid runs it"
    with pytest.raises(IparError, match="background_cores"):
        rank_grids(layers, (3, 16, 16), 4, 8, m.replace(background_cores=2.0), cores=2)


@pytest.mark.fast
@pytest.mark.parametrize("grid,overlaps", [("1x2", True), ("1x4", False), ("2x2", False)])
def test_a_submitted_step_ends_with_its_push_and_steps_within_a_program_overlap_it(
        grid, overlaps):
    """Worker programs push each new weight block to its readers as soon as it exists
    (``train_step(more=True)``, ``fit``), and a program ends when its pushes are done, so a
    step submitted alone (what the step model returns) is a step whose weights are in
    place at the start and whose new weights reach their readers by its end: the bytes of
    a step alone, no less time than its busiest link's sends or its cores' work, and no
    less than a step within a program of several (two steps' makespan less one's), where
    the next step's forward may overlap the push; on pure batch over two workers (the
    all-gather and the reduce-scatter of the whole weights) shorter than a step that
    all-gathers its weights at its start, since the push overlaps the backward. (Over four,
    that step's all-gather shares the links with the forward's blocks as well, and the two
    readings are within 5%.)"""
    from dask_ipar import Dense, Sequential
    from dask_ipar.cost import simulate_programs
    from dask_ipar.runtime.stepmodel import simulate_engine, step_tasks
    from dask_ipar.testing import fake_binding

    model = Sequential([Dense(512, "relu"), Dense(512, "relu"), Dense(10)], input_dim=512)
    engine = model._make_engine(fake_binding(grid))
    names = [f"w{k}" for k in range(len(engine.param_layouts))]
    # links and cores about equally busy: the overlap is worth most
    m = Machine(alpha_s=1e-3, bandwidth_Bps=1e9, word_bytes=4, flops_per_s=2e10,
                message_s=1e-4)
    kw = dict(flops_per_s=m.flops_per_s, mem_Bps=5e9, bandwidth_Bps=m.bandwidth_Bps,
              latency_s=m.message_s)
    runs = {}
    for steps in (1, 2):
        tasks, available = step_tasks(engine, names, 32, (512,), "float32", SGD(0.1, 0.9),
                                      steps=steps)
        runs[steps] = (simulate_programs(tasks, available=available, **kw), tasks)
    (one, tasks1), (two, _) = runs[1], runs[2]
    assert two.transfer_bytes == 2 * one.transfer_bytes > 0
    alone = simulate_engine(engine, names, 32, (512,), "float32", m, None, SGD(0.1, 0.9),
                            "programs")
    within = two.seconds - one.seconds
    assert alone.transfer_bytes == one.transfer_bytes
    assert simulate_engine(engine, names, 32, (512,), "float32", m, None, SGD(0.1, 0.9),
                           "programs", steps_per_program=4).seconds \
        == pytest.approx((alone.seconds + 3 * within) / 4)
    workers = {t.worker for t in tasks1}
    sent = one.transfer_bytes / len(workers)  # every worker sends alike on these grids
    compute = max(one.compute_s.values())
    for step in (alone.seconds, within):
        assert step >= max(sent / m.bandwidth_Bps, compute) * 0.999, (step, sent, compute)
    assert within <= 1.001 * alone.seconds, (within, alone.seconds)
    # the push goes as each new slice exists, beside the backward of the layers below; a
    # step whose weights were all-gathered at its start (what one step alone simulates)
    # waits for them first
    if overlaps:
        assert alone.seconds < 0.985 * one.seconds, (alone.seconds, one.seconds)
    else:
        assert alone.seconds <= 1.05 * one.seconds, (alone.seconds, one.seconds)


def _domain_conv_graph(backward: bool):
    """A 3x3 conv's step graph on 2x1 (32-row strips of 8 images, 16 channels, 64 wide):
    the forward, and with ``backward`` its backward too."""
    import numpy as np

    import dask_ipar.nn.conv as NC
    from dask_ipar.layout.grid import GridBinding, parse_grid
    from dask_ipar.nn.graph import StepGraph

    g = StepGraph()
    binding = GridBinding.placeholder(parse_grid("2x1"))

    def blocks(name, shape):
        return {(i, 0): g.add_data((name, i, 0), binding.worker(i, 0),
                                   np.zeros(shape, np.float32)).key for i in range(2)}

    x, w = blocks("x", (8, 16, 32, 64)), blocks("w", (16, 16 * 9 + 1))
    plan, a = NC.conv_forward_graph(g, binding, "conv0", "t", x, w, 64, (16, 16, 3, 3), 1,
                                    (1, 1, 1, 1), activation="relu")
    if backward:
        NC.conv_backward_graph(g, binding, "conv0", "t", plan, x, w, a,
                               blocks("dy", (8, 16, 32, 64)), 64, (16, 16, 3, 3), 1,
                               (1, 1, 1, 1), activation="relu")
    return g


def _programs_step(g, latency):
    """The programs' simulated step of ``g`` (1 GFLOP/s, 1 GB/s, links of ``latency``)."""
    from dask_ipar.cost import simulate_programs
    from dask_ipar.nn.graph import sim_tasks

    tasks, available = sim_tasks(g, {}, 4)
    return simulate_programs(tasks, flops_per_s=1e9, mem_Bps=1e9, bandwidth_Bps=1e12,
                             latency_s=latency, available=available).seconds


@pytest.mark.fast
def test_a_domain_conv_computes_its_interior_while_its_halo_rows_travel(monkeypatch):
    """Interior first (dask_ipar.nn.conv): in the programs' step model a conv's halo
    latency is hidden behind the rows a cell's own block gives, up to their compute; the
    same graph without the interior tasks pays it in full."""
    import dask_ipar.nn.conv as NC

    g = _domain_conv_graph(False)
    names = {k[0].split("-")[0] for k in g.dsk if isinstance(k, tuple)}
    assert "conv0.inner" in names  # 32-row strips, a 3x3 window: an interior to compute
    lone = _programs_step(g, 0.0)
    hidden = _programs_step(g, 0.02)  # well under the interior's compute (about 0.1 s here)
    monkeypatch.setattr(NC, "interior_rows", lambda *a, **k: None)
    g0 = _domain_conv_graph(False)
    assert not any(k[0].startswith("conv0.inner") for k in g0.dsk if isinstance(k, tuple))
    old, old_late = _programs_step(g0, 0.0), _programs_step(g0, 0.02)
    assert old_late == pytest.approx(old + 0.02)  # the halo's latency, paid in full
    assert hidden == pytest.approx(lone, abs=1e-9)  # hidden
    assert old <= lone < 1.1 * old  # the rims computed apart cost a little more


@pytest.mark.fast
def test_a_domain_conv_sends_its_halo_gradient_while_its_backward_runs(monkeypatch):
    """Rim first (dask_ipar.nn.conv): in the programs' step model the halo rows' input
    gradient travels while the cells run their whole backward, so a hop's latency up to
    that compute is hidden; without rim first the backward pays it in full."""
    import dask_ipar.nn.conv as NC

    g = _domain_conv_graph(True)
    assert any(getattr(t, "func", None) is NC.CK.conv_dx_edges for t in g.dsk.values())
    lone, hidden = _programs_step(g, 0.0), _programs_step(g, 0.02)
    monkeypatch.setattr(NC, "rim_first", lambda *a, **k: None)
    g0 = _domain_conv_graph(True)
    assert not any(getattr(t, "func", None) is NC.CK.conv_dx_edges for t in g0.dsk.values())
    old, old_late = _programs_step(g0, 0.0), _programs_step(g0, 0.02)
    assert old_late >= old + 0.019  # the backward's halo latency (less a copy) paid
    assert hidden == pytest.approx(lone, abs=1e-9)  # hidden (the forward's by interior first)
    assert old <= lone < 1.05 * old  # the edges computed apart and added cost a little


def _dense_1x2(width):
    """The engine of a ``width``-``width``-10 MLP on a placeholder 1x2 grid, its weight
    names, and a machine with a flop rate and a programs' hop."""
    from dask_ipar import Dense, Sequential
    from dask_ipar.testing import fake_binding

    model = Sequential([Dense(width, "relu"), Dense(10)], input_dim=width)
    engine = model._make_engine(fake_binding("1x2"))
    names = [f"w{k}" for k in range(len(engine.param_layouts))]
    return engine, names, Machine(alpha_s=1e-3, bandwidth_Bps=5e8, word_bytes=4,
                                  flops_per_s=2e10, message_s=1e-4)


@pytest.mark.fast
def test_the_programs_model_takes_the_machines_elementwise_and_exchange_rates():
    """The worker programs' step model charges element-wise work at the machine's measured
    ``elementwise_Bps`` (the fixed default where None) and sends at ``exchange_Bps`` where
    that is below the pair rate: the same step as the simulator given those rates
    directly, and ``exchange_Bps`` above the pair rate changes nothing."""
    from dask_ipar.cost import simulate_programs
    from dask_ipar.runtime.stepmodel import (ELEMENTWISE_BPS, _with_push, simulate_engine,
                                             step_tasks)

    engine, names, base = _dense_1x2(256)

    def direct(mem_Bps, bandwidth_Bps):  # a step alone with its push, as the model runs it
        kw = dict(flops_per_s=base.flops_per_s, mem_Bps=mem_Bps, bandwidth_Bps=bandwidth_Bps,
                  latency_s=base.message_s)
        tasks, available = step_tasks(engine, names, 32, (256,), "float32", SGD(0.1, 0.9),
                                      steps=2)
        return simulate_programs(_with_push(tasks, available), available=available,
                                 **kw).seconds

    def model_s(m):
        return simulate_engine(engine, names, 32, (256,), "float32", m, None, SGD(0.1, 0.9),
                               "programs").seconds

    assert model_s(base) == pytest.approx(direct(ELEMENTWISE_BPS, 5e8))
    m = base.replace(elementwise_Bps=2e9, exchange_Bps=1e8)
    assert model_s(m) == pytest.approx(direct(2e9, 1e8))
    assert model_s(m) > model_s(base)  # slower element-wise work, slower links
    assert model_s(base.replace(exchange_Bps=5e9)) == pytest.approx(model_s(base))


@pytest.mark.fast
def test_programs_charge_each_message_end_its_fixed_transport_cpu():
    """On shared cores every message costs its sender and its receiver
    ``message_cpu_s`` of CPU (a number, or a function of the message's bytes) beside the
    bytes' own: on one core, one block between two 1-second tasks makes the step 2 s plus
    both ends' message work; without ``cores`` (unshared cores) nothing is charged."""
    from dask_ipar.cost import SimTask, simulate_programs

    tasks = [SimTask("a", "A", (), flops=1e9, out_bytes=1000),
             SimTask("b", "B", ("a",), flops=1e9)]
    kw = dict(flops_per_s=1e9, mem_Bps=1e9, bandwidth_Bps=1e15, latency_s=0.0)
    assert simulate_programs(tasks, cores=1, **kw).seconds == pytest.approx(2.0)
    assert simulate_programs(tasks, cores=1, message_cpu_s=0.1, **kw).seconds \
        == pytest.approx(2.2)
    by_size = lambda n: 0.1 if n <= 100 else 0.3  # noqa: E731
    assert simulate_programs(tasks, cores=1, message_cpu_s=by_size, **kw).seconds \
        == pytest.approx(2.6)
    assert simulate_programs(tasks, message_cpu_s=0.1, **kw).seconds == pytest.approx(2.0)


@pytest.mark.fast
def test_dask_work_outside_the_programs_takes_its_share_of_shared_cores():
    """Where workers share cores, a submitted step's own dask work (``start_cpu_s`` per
    worker from its start) and dask's background work (``background_cores`` in all, all
    along) take their share of them; with a core per worker (``cores`` not given)
    neither is charged."""
    from dask_ipar.cost import SimTask, simulate_programs

    kw = dict(flops_per_s=1e9, mem_Bps=1e9, bandwidth_Bps=1e15, latency_s=0.0)
    two = [SimTask("a", "A", (), flops=1e9), SimTask("b", "B", (), flops=1e9)]
    assert simulate_programs(two, cores=2, **kw).seconds == pytest.approx(1.0)
    # each worker's 0.5 s of step work beside its 1 s task: four runners on two cores at
    # half speed until the step work is done at 1 s (tasks half done), then the tasks alone
    assert simulate_programs(two, cores=2, start_cpu_s=0.5, **kw).seconds \
        == pytest.approx(1.5)
    # half a core in all, all along: the tasks share 1.5 cores, 0.75 each
    assert simulate_programs(two, cores=2, background_cores=0.5, **kw).seconds \
        == pytest.approx(1 / 0.75)
    # both: 4 runners on 1.5 cores (0.375 each) until the step work is done at 4/3 s (the
    # tasks have 0.5 s left), then the tasks at 0.75 each: 2/3 s more
    assert simulate_programs(two, cores=2, start_cpu_s=0.5, background_cores=0.5,
                             **kw).seconds == pytest.approx(4 / 3 + 2 / 3)
    # unshared cores: nothing charged
    assert simulate_programs(two, start_cpu_s=0.5, background_cores=0.5, **kw).seconds \
        == pytest.approx(1.0)
    for bad in (dict(background_cores=2.0), dict(background_cores=-0.1),
                dict(start_cpu_s=-1.0)):
        with pytest.raises(ValueError, match="background_cores"):
            simulate_programs(two, cores=2, **bad, **kw)


@pytest.mark.fast
def test_the_programs_model_takes_dask_work_from_the_machine():
    """The worker programs' step model passes the machine's ``step_cpu_s`` and
    ``background_cores`` to the simulator: the same step as the simulator given them
    directly; on shared cores they lengthen the step, without ``cores`` they do not."""
    from dask_ipar.cost import simulate_programs
    from dask_ipar.runtime.stepmodel import (ELEMENTWISE_BPS, _with_push, simulate_engine,
                                             step_tasks)

    engine, names, base = _dense_1x2(512)
    dask_work = base.replace(step_cpu_s=0.01, background_cores=0.1)

    def model_s(m, cores):
        return simulate_engine(engine, names, 256, (512,), "float32", m, cores, SGD(0.1, 0.9),
                               "programs").seconds

    tasks, available = step_tasks(engine, names, 256, (512,), "float32", SGD(0.1, 0.9),
                                  steps=2)
    direct = simulate_programs(_with_push(tasks, available), available=available,
                               flops_per_s=2e10, mem_Bps=ELEMENTWISE_BPS, bandwidth_Bps=5e8,
                               latency_s=1e-4, cores=1, start_cpu_s=0.01,
                               background_cores=0.1).seconds
    assert model_s(dask_work, 1) == pytest.approx(direct)
    assert model_s(dask_work, 1) > model_s(base, 1)
    assert model_s(dask_work, None) == pytest.approx(model_s(base, None))


def test_the_network_stacks_work_on_the_computing_is_a_bytes_cpu_at_each_end():
    """The machine's ``stack_cpu_s_per_B`` (the network stack's work that lands on the
    kernels) is charged as the transports' CPU is, per byte at each end: the same step as
    a machine whose ``transfer_cpu_s_per_B`` holds both; on shared cores it lengthens a
    step that moves blocks, without ``cores`` it changes nothing."""
    from dask_ipar.runtime.stepmodel import simulate_engine

    engine, names, base = _dense_1x2(512)
    base = base.replace(transfer_cpu_s_per_B=4e-10)

    def model_s(m, cores):
        return simulate_engine(engine, names, 256, (512,), "float32", m, cores, SGD(0.1, 0.9),
                               "programs").seconds

    stack = base.replace(stack_cpu_s_per_B=3e-9)
    assert model_s(stack, 1) == pytest.approx(
        model_s(base.replace(transfer_cpu_s_per_B=3.4e-9), 1))
    assert model_s(stack, 1) > model_s(base, 1)
    assert model_s(stack, None) == pytest.approx(model_s(base, None))


@pytest.mark.fast
def test_the_simulated_step_graph_runs_and_is_what_the_model_costs():
    """``sim_step_graph`` is the graph ``step_tasks`` costs (the same tasks, dependencies
    and costs), and its kernels run as they stand on arrays of the external blocks'
    shapes (what ``benchmarks/step_replay.py`` times): every block of the step's dtype has
    the bytes the model costs it by (the loss statistics are float64 by design)."""
    from dask._task_spec import DataNode, TaskRef

    from dask_ipar.nn.graph import sim_tasks
    from dask_ipar.runtime.stepmodel import sim_step_graph, step_tasks

    engine, names, _ = _dense_1x2(64)
    opt = SGD(0.1, 0.9)
    g, external = sim_step_graph(engine, names, 16, (64,), "float32", opt)
    tasks, available = step_tasks(engine, names, 16, (64,), "float32", opt)
    again, avail_again = sim_tasks(g, external, 4)
    assert [(t.key, t.worker, t.deps, t.flops, t.mem_bytes, t.out_bytes) for t in again] \
        == [(t.key, t.worker, t.deps, t.flops, t.mem_bytes, t.out_bytes) for t in tasks]
    assert avail_again == available
    rng = np.random.default_rng(0)
    vals = {k: rng.standard_normal(s).astype(np.float32) for k, (_, s) in external.items()}
    by_key = {t.key: t for t in tasks}
    checked = blocks = 0
    for key, node in g.dsk.items():
        if isinstance(node, DataNode):
            vals[key] = node.value
            continue
        vals[key] = node({a.key: vals[a.key] for a in node.args if isinstance(a, TaskRef)})
        if isinstance(vals[key], np.ndarray) and vals[key].dtype == np.float32:
            checked += 1
            assert vals[key].nbytes == by_key[key].out_bytes, key
            # its element-wise rate's size: the largest of the arrays it read and wrote
            arrays = [vals[key]] + [vals[a.key] for a in node.args if isinstance(a, TaskRef)
                                    and isinstance(vals[a.key], np.ndarray)]
            if all(a.dtype == np.float32 for a in arrays):
                blocks += 1
                assert by_key[key].block_bytes == max(a.nbytes for a in arrays), key
    assert checked > 10 and blocks > 10


@pytest.mark.fast
def test_the_elementwise_rate_goes_by_the_size_of_a_tasks_arrays():
    """With two element-wise rates (``elementwise_Bps`` at 4 MiB blocks and below,
    ``elementwise_large_Bps`` at 16 MiB and above), a task's bytes take the seconds per
    byte of its largest array's size, linear in its logarithm between; one rate without."""
    from dask_ipar.cost import Machine, SimTask, simulate_programs

    m = Machine(flops_per_s=1e11, elementwise_Bps=2e10, elementwise_large_Bps=1e10)
    mib = 2**20
    assert m.elementwise_s_per_B(mib, 5e9) == pytest.approx(1 / 2e10)
    assert m.elementwise_s_per_B(4 * mib, 5e9) == pytest.approx(1 / 2e10)
    assert m.elementwise_s_per_B(8 * mib, 5e9) == pytest.approx(0.5 / 2e10 + 0.5 / 1e10)
    assert m.elementwise_s_per_B(64 * mib, 5e9) == pytest.approx(1 / 1e10)
    assert Machine(elementwise_Bps=2e10).elementwise_s_per_B(64 * mib, 5e9) == 1 / 2e10
    assert Machine().elementwise_s_per_B(64 * mib, 5e9) == 1 / 5e9
    tasks = [SimTask("small", "A", (), mem_bytes=1e9, block_bytes=mib),
             SimTask("large", "B", (), mem_bytes=1e9, block_bytes=32 * mib)]
    kw = dict(flops_per_s=1e11, mem_Bps=2e10, bandwidth_Bps=1e9, latency_s=0.0)
    r = simulate_programs(tasks, **kw, mem_s_per_B=lambda b, kind: m.elementwise_s_per_B(b, 5e9))
    assert r.compute_s == pytest.approx({"A": 0.05, "B": 0.1})
    assert simulate_programs(tasks, **kw).compute_s == pytest.approx({"A": 0.05, "B": 0.05})


@pytest.mark.fast
def test_the_conv_fronts_kernels_take_their_own_element_wise_rates():
    """``conv_Bps``: a task of kind ``"conv"`` (the conv front's strided kernels) takes it,
    at every block size; the other tasks, and every task where the machine has none, the
    common rates by size. In a CNN's simulated step the
    conv and pooling kernels are that kind, the dense ones not, and a slower conv rate
    lengthens the step by exactly their bytes' extra seconds on one worker."""
    from dask_ipar import Conv2d, Dense, Flatten, MaxPool2d
    from dask_ipar.cost import Machine, SimTask, simulate_programs
    from dask_ipar.kernels.conv_costs import CONV_COSTS, CONV_KERNELS
    from dask_ipar.kernels.costs import kernel_kind
    from dask_ipar.kernels import blocks as BK, conv as CK, dense as DK
    from dask_ipar.runtime.gridrank import simulate_layers
    from dask_ipar import Sequential
    from dask_ipar.runtime.stepmodel import step_tasks
    from dask_ipar.testing import fake_binding

    mib = 2**20
    m = Machine(flops_per_s=1e11, elementwise_Bps=2e10, elementwise_large_Bps=1e10,
                conv_Bps=8e9)
    for size in (mib, 8 * mib, 64 * mib):  # one conv rate for every size
        assert m.elementwise_s_per_B(size, 5e9, turns=4, kind="conv") == pytest.approx(1 / 8e9)
    assert m.elementwise_s_per_B(mib, 5e9) == pytest.approx(1 / 2e10)
    assert m.elementwise_s_per_B(64 * mib, 5e9) == pytest.approx(1 / 1e10)
    plain = m.replace(conv_Bps=None)
    assert plain.elementwise_s_per_B(mib, 5e9, kind="conv") == pytest.approx(1 / 2e10)
    assert plain.elementwise_s_per_B(64 * mib, 5e9, kind="conv") == pytest.approx(1 / 1e10)
    tasks = [SimTask("c", "A", (), mem_bytes=1e9, block_bytes=mib, kind="conv"),
             SimTask("d", "B", (), mem_bytes=1e9, block_bytes=mib)]
    kw = dict(flops_per_s=1e11, mem_Bps=2e10, bandwidth_Bps=1e9, latency_s=0.0)
    r = simulate_programs(tasks, **kw, mem_s_per_B=lambda b, kind: m.elementwise_s_per_B(
        b, 5e9, kind=kind))
    assert r.compute_s == pytest.approx({"A": 1 / 8, "B": 0.05})
    assert {kernel_kind(f) for f in (CK.conv_block, CK.conv_block_backward, CK.pool_block,
                                      CK.pool_block_backward)} == {"conv"}
    assert {kernel_kind(f) for f in (DK.dense_forward, DK.sgd_update, BK.take_rows)} == {""}
    assert CONV_KERNELS <= set(CONV_COSTS)  # each a kernel the cost model knows

    net = [Conv2d(16, 3, padding=1, activation="relu"), MaxPool2d(2), Flatten(),
           Dense(64, "relu"), Dense(10)]
    engine = Sequential(net, input_shape=(3, 16, 16))._make_engine(fake_binding("1x1"))
    names = [f"w{k}" for k in range(len(engine.param_layouts))]
    tasks, _ = step_tasks(engine, names, 8, (3, 16, 16), "float32", SGD(0.1))
    conv = [t for t in tasks if t.kind == "conv"]
    assert conv and any(t.kind == "" and t.mem_bytes for t in tasks)
    m1 = Machine(flops_per_s=1e11, elementwise_Bps=2e10)
    slow = m1.replace(conv_Bps=1e10)
    extra = sum(t.mem_bytes for t in conv) * (1 / 1e10 - 1 / 2e10)
    a = simulate_layers(net, (3, 16, 16), "1x1", 8, m1, cores=1)
    b = simulate_layers(net, (3, 16, 16), "1x1", 8, slow, cores=1)
    assert b.seconds - a.seconds == pytest.approx(extra, rel=1e-6)


@pytest.mark.fast
def test_workers_taking_turns_on_a_core_price_their_blocks_as_that_many_times_larger():
    """Where worker processes outnumber the cores they share, each kernel's block is priced
    at the element-wise rate of a block ``workers / cores`` times its size (the others'
    blocks go through the caches between two of its kernels); one worker a core or more,
    or no cores given, leaves the price as it was."""
    from dask_ipar.runtime.stepmodel import core_turns

    m = Machine(flops_per_s=1e11, elementwise_Bps=2e10, elementwise_large_Bps=1e10)
    mib = 2**20
    assert (core_turns(8, 2), core_turns(4, 2), core_turns(2, 2), core_turns(2, 8)) == (4, 2, 1, 1)
    assert core_turns(8, None) == 1
    assert m.elementwise_s_per_B(mib, 5e9, turns=4) == pytest.approx(1 / 2e10)
    assert m.elementwise_s_per_B(2 * mib, 5e9, turns=4) == pytest.approx(0.5 / 2e10 + 0.5 / 1e10)
    assert m.elementwise_s_per_B(4 * mib, 5e9, turns=4) == pytest.approx(1 / 1e10)
    assert m.elementwise_s_per_B(4 * mib, 5e9, turns=0.5) == pytest.approx(1 / 2e10)


@pytest.mark.fast
def test_the_simulated_step_prices_blocks_by_the_workers_on_each_core(monkeypatch):
    """A CNN's step on 8 workers sharing 2 cores costs more where its kernels' blocks are
    priced as 4 times their size than at their own (the large blocks' rate is the slower),
    and nothing changes on as many cores as workers."""
    from dask_ipar import Conv2d, Dense, Flatten, MaxPool2d
    from dask_ipar.runtime import stepmodel
    from dask_ipar.runtime.gridrank import simulate_layers

    net = [Conv2d(32, 3, padding=1, activation="relu"), MaxPool2d(2), Flatten(),
           Dense(512, "relu"), Dense(10)]
    m = Machine(flops_per_s=1e11, elementwise_Bps=2e10, elementwise_large_Bps=5e9)

    def step(cores):
        return simulate_layers(net, (3, 32, 32), "8x1", 64, m, cores=cores).seconds

    shared, own = step(2), step(8)
    monkeypatch.setattr(stepmodel, "core_turns", lambda workers, cores: 1.0)
    assert shared > 1.05 * step(2)
    assert own == step(8)


@pytest.mark.fast
def test_the_programs_loops_cost_their_cpu_on_every_task():
    """``program_task_cpu_s``: every task of a step run as programs costs that much more
    CPU on its worker, so the step lasts at least the busiest worker's tasks times it."""
    import collections

    from dask_ipar import Dense
    from dask_ipar.runtime.gridrank import simulate_layers

    net = [Dense(64, "relu"), Dense(64, "relu"), Dense(10)]
    m = Machine(flops_per_s=1e11, elementwise_Bps=2e10, message_s=1e-5)
    cost = 1e-2  # far above the step's own work
    base = simulate_layers(net, (64,), "2x2", 32, m, cores=4)
    loaded = simulate_layers(net, (64,), "2x2", 32, m.replace(program_task_cpu_s=cost), cores=4)
    from dask_ipar import Sequential
    from dask_ipar.optim import SGD
    from dask_ipar.runtime.stepmodel import step_tasks
    from dask_ipar.testing import fake_binding

    engine = Sequential(net, input_dim=64)._make_engine(fake_binding("2x2"))
    names = [f"w{k}" for k in range(len(engine.param_layouts))]
    tasks = collections.Counter(t.worker for t in step_tasks(
        engine, names, 32, (64,), "float32", SGD(0.01, momentum=0.9))[0])
    # the busiest worker's tasks, each at the loop's cost; the next step's tasks (which
    # the prediction keeps only as readers of the pushed weights) cost nothing
    busiest = max(tasks.values()) * cost
    assert busiest <= loaded.seconds < base.seconds + 1.2 * busiest
    assert busiest > 10 * base.seconds
    # the graph executor has no programs: its step does not change
    graph = [simulate_layers(net, (64,), "2x2", 32, mm, cores=4, executor="graph").seconds
             for mm in (m, m.replace(program_task_cpu_s=cost))]
    assert graph[0] == graph[1]
