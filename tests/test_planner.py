"""Planner and `dask-ipar plan` CLI tests."""

import argparse
import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_ipar.cli import plan as plan_cli
from dask_ipar.cost import (
    FC,
    MODES,
    PAPER_MACHINE,
    Conv2d,
    Machine,
    Pool2d,
    alexnet,
    evaluate_grid,
    factorizations,
    mlp,
    network_flops,
    network_phases,
    plan,
)

pytestmark = pytest.mark.fast  # no cluster: graphs, kernels and formulas only

N_IMAGENET = 1_200_000


def test_factorizations_are_all_divisor_pairs():
    assert factorizations(12) == [(1, 12), (2, 6), (3, 4), (4, 3), (6, 2), (12, 1)]
    assert factorizations(1) == [(1, 1)]
    assert len(factorizations(8192)) == 14
    assert factorizations(97) == [(1, 97), (97, 1)]
    with pytest.raises(ValueError, match="procs: got 0"):
        factorizations(0)


@pytest.mark.parametrize("conv", MODES)
def test_alexnet_p8192_plans_in_under_one_second(conv):
    layers = alexnet()
    start = time.perf_counter()
    result = plan(layers, 8192, 8192, PAPER_MACHINE, conv=conv, samples=N_IMAGENET)
    elapsed = time.perf_counter() - start
    assert len(result.grids) == 14
    assert result.best is not None
    assert elapsed < 1.0, f"planning took {elapsed:.3f} s"


def test_model_mode_grid_total_is_network_phases():
    """With every layer model-parallel, the planner's comm is the sum of Eq. 8 phases."""
    layers = alexnet()
    for pr, pc in [(1, 64), (8, 8), (64, 1)]:
        g = evaluate_grid(layers, pr, pc, 256, PAPER_MACHINE, conv="model", convention="paper")
        assert g.comm_s == pytest.approx(sum(p.seconds for p in network_phases(layers, pr, pc, 256, PAPER_MACHINE,
                                                                                convention="paper")))
        assert g.domain_comm_s == 0


def test_pure_batch_grid_is_the_same_in_every_mode():
    totals = {m: evaluate_grid(alexnet(), 1, 64, 256, PAPER_MACHINE, conv=m).total_s for m in MODES}
    assert max(totals.values()) == pytest.approx(min(totals.values()))


SMALL_CNN = [
    Conv2d(32, 32, 3, 16, 3, 3, padding=1, name="c1"),
    Pool2d(32, 32, 16, 2, name="p1"),
    Conv2d(16, 16, 16, 32, 5, 5, padding=2, name="c2"),
    Conv2d(16, 16, 32, 32, 1, 1, name="c3"),
    Pool2d(16, 16, 32, 2, name="p2"),
    FC(8 * 8 * 32, 256, name="f1"),
    FC(256, 10, name="f2"),
]


@settings(max_examples=40, deadline=None)
@given(
    net=st.sampled_from(["alexnet", "cnn"]),
    procs=st.sampled_from([1, 4, 6, 12, 64, 96, 512, 1024]),
    batch=st.sampled_from([8, 32, 128, 512, 2048]),
    alpha=st.floats(0, 1e-4),
    bw=st.floats(1e8, 1e11),
    compute=st.one_of(st.none(), st.floats(0, 1.0)),
    overlap=st.booleans(),
    convention=st.sampled_from(["engine", "paper"]),
)
def test_auto_is_never_worse_than_any_fixed_mode(net, procs, batch, alpha, bw, compute, overlap, convention):
    layers = alexnet() if net == "alexnet" else SMALL_CNN
    machine = Machine(alpha_s=alpha, bandwidth_Bps=bw, compute_s_per_iter=compute)
    results = {m: plan(layers, procs, batch, machine, conv=m, overlap=overlap, convention=convention) for m in MODES}
    auto = results["auto"]
    for mode in ("batch", "model", "domain"):
        fixed = results[mode]
        for ga, gf in zip(auto.grids, fixed.grids):
            if gf.feasible:
                assert ga.feasible and ga.total_s <= gf.total_s * (1 + 1e-12)
        if fixed.best is not None:
            assert auto.best.total_s <= fixed.best.total_s * (1 + 1e-12)
    for g in auto.feasible:  # parts add up and nothing is negative
        parts = (g.compute_s, g.batch_comm_s, g.model_comm_s, g.domain_comm_s)
        assert min(parts) >= 0 and g.total_s == pytest.approx(sum(parts))


def test_memory_limit_excludes_grids():
    full = plan(alexnet(), 64, 256, PAPER_MACHINE, conv="model")
    mems = sorted(g.mem_bytes for g in full.feasible)
    limit = mems[len(mems) // 2]
    limited = plan(alexnet(), 64, 256, PAPER_MACHINE, conv="model", mem_limit_bytes=limit)
    assert 0 < len(limited.feasible) < len(full.feasible)
    assert all(g.mem_bytes <= limit for g in limited.feasible)
    assert any("bytes per process" in g.reason for g in limited.grids if not g.feasible)
    assert plan(alexnet(), 64, 256, PAPER_MACHINE, mem_limit_bytes=1).best is None


def test_memory_shrinks_with_model_parallelism_for_fc_heavy_nets():
    net = mlp([4096, 8192, 8192, 10])
    mems = [evaluate_grid(net, pr, 64 // pr, 64, PAPER_MACHINE).mem_bytes for pr in (1, 2, 4, 8)]
    assert mems == sorted(mems, reverse=True)


def test_overlap_hides_weight_allreduce_up_to_backward_compute():
    compute = 0.01
    machine = PAPER_MACHINE.replace(compute_s_per_iter=compute)
    plain = evaluate_grid(alexnet(), 4, 16, 256, machine, conv="model")
    over = evaluate_grid(alexnet(), 4, 16, 256, machine, conv="model", overlap=True)
    assert over.batch_comm_s == pytest.approx(max(0.0, plain.batch_comm_s - 2 / 3 * compute))
    assert over.model_comm_s == plain.model_comm_s
    no_compute = evaluate_grid(alexnet(), 4, 16, 256, PAPER_MACHINE, conv="model", overlap=True)
    assert no_compute.batch_comm_s == pytest.approx(plain.batch_comm_s)


def test_compute_from_flop_rate():
    machine = PAPER_MACHINE.replace(flops_per_s=1e12)
    g = evaluate_grid(alexnet(), 2, 4, 64, machine)
    assert g.compute_s == pytest.approx(network_flops(alexnet(), 64) / (8 * 1e12))


def test_domain_parallelism_scales_past_the_batch_size():
    """P > B: pure batch is impossible, domain-parallel conv layers with Pc <= B still run (paper, Sec. on P > B)."""
    result = plan(alexnet(), 4096, 512, PAPER_MACHINE, conv="domain")
    assert not result.grids[0].feasible and result.speedup_vs_batch is None
    assert result.best is not None and result.best.pc <= 512
    assert all(g.pc <= 512 for g in result.feasible)
    assert plan(alexnet(), 4096, 512, PAPER_MACHINE, conv="batch").best is None
    auto = plan(alexnet(), 4096, 512, PAPER_MACHINE, conv="auto", convention="paper")
    assert dict(auto.best.schemes)["conv1"] == "domain"


@pytest.mark.parametrize("convention", ["engine", "paper"])
@pytest.mark.parametrize("conv", ["model", "batch", "auto"])
def test_paper_result_best_grid_is_neither_pure_batch_nor_pure_model(conv, convention):
    """Paper machine (2 us, 6 GiB/s, 4-byte words, N = 1.2M), AlexNet at large P."""
    result = plan(alexnet(), 512, 2048, PAPER_MACHINE, conv=conv, convention=convention, samples=N_IMAGENET)
    assert result.unit == "epoch"
    assert 1 < result.best.pr < 512
    assert result.speedup_vs_batch > 1.5
    assert result.comm_speedup_vs_batch > 1.5


def test_per_epoch_scaling():
    it = plan(alexnet(), 16, 256, PAPER_MACHINE)
    ep = plan(alexnet(), 16, 256, PAPER_MACHINE, samples=N_IMAGENET)
    for a, b in zip(it.feasible, ep.feasible):
        assert b.total_s == pytest.approx(a.total_s * N_IMAGENET / 256)
        assert b.mem_bytes == a.mem_bytes


def test_planner_errors():
    with pytest.raises(ValueError, match="conv: got 'hybrid'"):
        plan(alexnet(), 8, 8, PAPER_MACHINE, conv="hybrid")
    with pytest.raises(ValueError, match="convention: got 'mpi'"):
        plan(alexnet(), 8, 8, PAPER_MACHINE, convention="mpi")
    with pytest.raises(ValueError, match="batch: got 0"):
        plan(alexnet(), 8, 0, PAPER_MACHINE)


# ---------------------------------------------------------------- CLI


def run_cli(capsys, *argv):
    parser = argparse.ArgumentParser(prog="dask-ipar")
    plan_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_table(capsys):
    rc, out, err = run_cli(capsys, "--model", "alexnet", "--batch", "2048", "--procs", "512", "--conv", "model")
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert "compute_s" in out and "batch_comm_s" in out and "model_comm_s" in out and "domain_comm_s" in out
    starred = [ln for ln in lines if ln.startswith("*")]
    assert len(starred) == 1
    assert "best:" in out and "speedup vs pure batch" in out
    assert sum(1 for ln in lines if ln[2:].split()[:1] and ln[2:].split()[0].isdigit()) == 10


def test_cli_json(capsys):
    rc, out, _ = run_cli(capsys, "--model", "784,4096,4096,10", "--batch", "256", "--procs", "12", "--json",
                         "--samples", "60000", "--bandwidth", "10Gbit", "--alpha", "1e-6", "--word-bytes", "4",
                         "--compute-s-per-iter", "0.001", "--convention", "paper")
    assert rc == 0
    data = json.loads(out)
    assert data["unit"] == "epoch"
    assert [(g["pr"], g["pc"]) for g in data["grids"]] == factorizations(12)
    for g in data["grids"]:
        assert set(g) == {"pr", "pc", "compute_s", "batch_comm_s", "model_comm_s", "domain_comm_s", "total_s",
                          "mem_bytes", "replica_comm_s"}
        assert g["replica_comm_s"] == 0.0
        assert g["compute_s"] == pytest.approx(0.001 * 60000 / 256)
    assert set(data["best"]) == {"pr", "pc", "speedup_vs_batch", "comm_speedup_vs_batch"}
    best = min(data["grids"], key=lambda g: g["total_s"])
    assert (data["best"]["pr"], data["best"]["pc"]) == (best["pr"], best["pc"])
    assert data["best"]["speedup_vs_batch"] == pytest.approx(data["grids"][0]["total_s"] / best["total_s"])


def test_cli_machine_file_and_mem_limit(tmp_path, capsys):
    path = tmp_path / "machine.yaml"
    path.write_text("alpha_s: 1.0e-5\nbandwidth_Bps: 1GiB\nword_bytes: 4\n")
    rc, out, _ = run_cli(capsys, "--batch", "256", "--procs", "16", "--machine", str(path), "--json",
                         "--mem-limit", "300MiB", "--overlap", "--conv", "auto")
    assert rc == 0
    data = json.loads(out)
    assert all(g["mem_bytes"] <= 300 * 2**20 for g in data["grids"])
    assert len(data["grids"]) < 5


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--batch", "64", "--procs", "8", "--bandwidth", "fast"], "--bandwidth: could not parse 'fast'"),
        (["--batch", "64", "--procs", "8", "--model", "lenet"], "--model: got 'lenet'"),
        (["--batch", "0", "--procs", "8"], "--batch: got 0"),
        (["--batch", "64", "--procs", "-2"], "--procs: got -2"),
        (["--batch", "64", "--procs", "8", "--mem-limit", "lots"], "--mem-limit"),
        (["--batch", "64", "--procs", "8", "--machine", "/nonexistent/m.yaml"], "machine file"),
        (["--batch", "64", "--procs", "8", "--alpha", "-1"], "--alpha: got -1"),
    ],
)
def test_cli_bad_input_exits_2_without_traceback(capsys, argv, needle):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == ""
    assert needle in err and ("expected" in err or "give" in err)
    assert "Traceback" not in err


def test_cli_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    rc, _, _ = run_cli(capsys, "--batch", "512", "--procs", "64", "--plot", str(png))
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plot_without_matplotlib(tmp_path, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    rc, _, err = run_cli(capsys, "--batch", "64", "--procs", "8", "--plot", str(tmp_path / "x.png"))
    assert rc == 2 and "matplotlib is not installed" in err and "pip install" in err


def test_cli_infeasible_everything_returns_1(capsys):
    rc, out, _ = run_cli(capsys, "--batch", "64", "--procs", "8", "--mem-limit", "1")
    assert rc == 1 and "no grid is feasible" in out
