"""The step-time simulator on small task graphs with hand-computed answers, and on a real step."""

from __future__ import annotations

import pytest

from dask_ipar.cost import Machine, SimTask, simulate_step


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
