"""Cost model tests: closed forms of Eqs. 3-8 computed by hand, exact engine bytes,
network shapes, machine parsing, property tests."""

import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_ipar.cost import (
    FC,
    PAPER_MACHINE,
    Conv2d,
    Machine,
    Pool2d,
    alexnet,
    allgather_cost,
    allreduce_cost,
    batch_layer_phases,
    batch_model_crossover,
    conv_model_phases,
    count_params,
    dense_layer_phases,
    domain_layer_phases,
    get_network,
    layer_memory_bytes,
    load_machine,
    mlp,
    network_phases,
    parse_bandwidth,
    parse_bytes,
    point_to_point_cost,
    redistribute_phase,
    resnet50,
    save_machine,
    vgg16,
)

M = PAPER_MACHINE
ALPHA, BW, WB = M.alpha_s, M.bandwidth_Bps, M.word_bytes
BETA = WB / BW  # seconds per word


def clog(p):
    return math.ceil(math.log2(p)) if p > 1 else 0


def total(phases):
    return sum(p.seconds for p in phases)


# ---------------------------------------------------------------- machine


@pytest.mark.parametrize(
    "text, expected",
    [("6GiB", 6 * 2**30), ("6GiB/s", 6 * 2**30), ("125MB", 125e6), ("1Gbit", 125e6), ("4e9", 4e9), (1000, 1000),
     ("512 KiB", 512 * 1024), ("10gb", 10e9)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == pytest.approx(expected)


@pytest.mark.parametrize("bad", ["6 parsecs", "", "GiB", "-5MB", "1.2.3GB"])
def test_parse_bytes_errors_name_argument_and_fix(bad):
    with pytest.raises(ValueError, match="--bandwidth.*expected"):
        parse_bandwidth(bad, name="--bandwidth")


def test_machine_validation_and_beta():
    assert Machine().beta_s_per_word == pytest.approx(4 / (6 * 2**30))
    with pytest.raises(ValueError, match="alpha_s: got -1"):
        Machine(alpha_s=-1)
    with pytest.raises(ValueError, match="bandwidth_Bps"):
        Machine(bandwidth_Bps=0)
    assert Machine(compute_s_per_iter=0.5).compute_s(1e12, 8) == 0.5
    assert Machine(flops_per_s=1e9).compute_s(8e9, 8) == pytest.approx(1.0)
    assert Machine().compute_s(1e9, 8) == 0.0


def test_machine_yaml_roundtrip(tmp_path):
    m = Machine(alpha_s=1e-6, bandwidth_Bps=1e10, word_bytes=2, flops_per_s=1e12,
                elementwise_Bps=1.8e10, elementwise_large_Bps=1.5e10, conv_Bps=9e9,
                stack_cpu_s_per_B=1.4e-10)
    path = tmp_path / "m.yaml"
    save_machine(m, path)
    assert load_machine(path) == m
    path.write_text("alpha_s: 3.0e-6\nbandwidth_Bps: 6GiB\n")
    assert load_machine(path) == Machine(alpha_s=3e-6, bandwidth_Bps=6 * 2**30)
    path.write_text("alpha: 1\n")
    with pytest.raises(ValueError, match="unknown keys"):
        load_machine(path)


# ---------------------------------------------------------------- networks


def test_alexnet_shapes_and_parameters():
    net = alexnet()
    convs = [x for x in net if isinstance(x, Conv2d)]
    assert [(c.out_h, c.out_w, c.out_c) for c in convs] == [
        (55, 55, 96), (27, 27, 256), (13, 13, 384), (13, 13, 384), (13, 13, 256)]
    assert [c.n_params - c.out_c for c in convs] == [34848, 307200, 884736, 663552, 442368]
    assert [x.n_params - x.d_out for x in net if isinstance(x, FC)] == [37748736, 16777216, 4096000]
    assert net[-4].d_out == 9216
    assert count_params(net) == 60_965_224


def test_vgg16_and_resnet50_parameters():
    assert count_params(vgg16()) == 138_357_544
    r = resnet50()
    assert count_params(r) == 25_503_912  # torchvision 25,557,032 minus 53,120 batch-norm parameters
    one_by_one = [x for x in r if isinstance(x, Conv2d) and x.k_h == 1]
    assert len(one_by_one) == 2 * 16 + 4  # two per bottleneck + 4 projections
    assert sum(isinstance(x, Conv2d) for x in r) == 53


def test_get_network_and_errors():
    assert get_network("784,4096,4096,10") == mlp([784, 4096, 4096, 10])
    assert get_network([5, 3]) == [FC(5, 3, name="fc1")]
    assert get_network("AlexNet") == alexnet()
    with pytest.raises(ValueError, match="model: got 'lenet'.*expected"):
        get_network("lenet")
    with pytest.raises(ValueError, match="widths"):
        mlp([5])


def test_engine_model_is_accepted_duck_typed():
    class Dense:
        def __init__(self, units, bias=True):
            self.units, self.bias = units, bias

    class Seq:
        layers = (Dense(32), Dense(10, bias=False))
        input_dim = 64

    assert get_network(Seq()) == [FC(64, 32, name="dense0"), FC(32, 10, bias=False, name="dense1")]


def test_conv_shapes_and_errors():
    c = Conv2d(224, 224, 3, 64, 7, 7, stride=2, padding=3)
    assert (c.out_h, c.out_w) == (112, 112)
    assert Pool2d(55, 55, 96, 3, 2).out_h == 27
    with pytest.raises(ValueError, match="groups"):
        Conv2d(8, 8, 3, 4, 3, 3, groups=2)
    with pytest.raises(ValueError, match="no output"):
        Conv2d(2, 2, 3, 4, 5, 5)


# ---------------------------------------------------------------- collectives


def test_collectives_closed_forms():
    n = 1000.0
    c = allgather_cost(8, n, M)
    assert c.messages == 3 and c.seconds == pytest.approx(3 * ALPHA + 7 / 8 * n / BW)
    c = allreduce_cost(6, n, M)
    assert c.seconds == pytest.approx(2 * (3 * ALPHA + 5 / 6 * n / BW))
    d = allgather_cost(6, n, M, algorithm="direct")
    assert d.messages == 5 and d.latency_s == pytest.approx(5 * ALPHA)
    assert allreduce_cost(1, n, M).seconds == 0
    assert point_to_point_cost(0, M).seconds == 0


# ---------------------------------------------------------------- engine convention: exact bytes


def blocks(n, p):
    return [n // p + (1 if r < n % p else 0) for r in range(p)]


def brute_force_dense(n, m, bias, pr, pc, b):
    """Bytes received by every process, enumerated process by process."""
    cols = n + bias
    rows_m, rows_n, bs, cs = blocks(m, pr), blocks(n, pr), blocks(b, pc), blocks(cols, pc)
    recv = {k: {} for k in ("fwd_gather", "dx_reduce", "dw_reduce", "w_gather")}
    for i in range(pr):
        for j in range(pc):
            # all-gather: receive every other row block of Y(:, j)
            recv["fwd_gather"][i, j] = sum(rows_m[k] * bs[j] for k in range(pr) if k != i)
            # reduce-scatter of dX(:, j): receive own block from every other process
            recv["dx_reduce"][i, j] = (pr - 1) * rows_n[i] * bs[j]
            # dW row block i, reduce-scatter to column slice owners, then all-gather the slices
            recv["dw_reduce"][i, j] = (pc - 1) * rows_m[i] * cs[j]
            recv["w_gather"][i, j] = sum(rows_m[i] * cs[k] for k in range(pc) if k != j)
    return recv


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40), m=st.integers(1, 40), bias=st.booleans(), pr=st.integers(1, 7),
    pc=st.integers(1, 7), b=st.integers(1, 30), first=st.booleans(),
)
def test_engine_dense_bytes_match_enumeration(n, m, bias, pr, pc, b, first):
    phases = {p.phase: p for p in dense_layer_phases(FC(n, m, bias=bias), pr, pc, b, M, first_layer=first)}
    ref = brute_force_dense(n, m, int(bias), pr, pc, b)
    expected_phases = {"fwd_gather", "dw_reduce", "w_gather"} | (set() if first else {"dx_reduce"})
    assert set(phases) == expected_phases
    for name, phase in phases.items():
        assert phase.total_bytes == sum(ref[name].values()) * WB
        assert phase.max_bytes_per_process == max(ref[name].values()) * WB
        group = pr if name in ("fwd_gather", "dx_reduce") else pc
        assert phase.messages == group - 1
        assert phase.latency_s == pytest.approx(ALPHA * (group - 1))
        assert phase.bandwidth_s == pytest.approx(phase.max_bytes_per_process / BW)


def test_engine_dense_closed_form_totals():
    n, m, pr, pc, b = 97, 31, 5, 3, 17
    ph = {p.phase: p for p in dense_layer_phases(FC(n, m), pr, pc, b, M, first_layer=False)}
    assert ph["fwd_gather"].total_bytes == (pr - 1) * m * b * WB
    assert ph["dx_reduce"].total_bytes == (pr - 1) * n * b * WB
    assert ph["dw_reduce"].total_bytes == (pc - 1) * m * (n + 1) * WB
    assert ph["w_gather"].total_bytes == (pc - 1) * m * (n + 1) * WB


def test_engine_even_split_per_process_matches_eq8_bandwidth():
    n, m, pr, pc, b = 64, 48, 4, 2, 16
    w = m * (n + 1)
    ph = {p.phase: p for p in dense_layer_phases(FC(n, m), pr, pc, b, M, first_layer=False)}
    assert ph["fwd_gather"].max_bytes_per_process == (pr - 1) / pr * m * b / pc * WB
    assert ph["dx_reduce"].max_bytes_per_process == (pr - 1) / pr * n * b / pc * WB
    w_rows_per_pr = m // pr * (n + 1)
    assert ph["dw_reduce"].max_bytes_per_process + ph["w_gather"].max_bytes_per_process == pytest.approx(
        2 * (pc - 1) / pc * w_rows_per_pr * WB, rel=0.05)
    assert w == m * (n + 1)


# ---------------------------------------------------------------- paper convention: Eqs. 3, 4, 8


def eq8(net, pr, pc, b, dx="paper"):
    """Eq. 8 summed by hand over every weighted layer."""
    t = 0.0
    for layer in net:
        if isinstance(layer, Pool2d):
            continue
        d, dxd, w = layer.d_out, (layer.d_out if dx == "paper" else layer.d_in), layer.n_params
        t += ALPHA * clog(pr) + BETA * b * (pr - 1) / pr * d / pc
        t += 2 * (ALPHA * clog(pr) + BETA * b * (pr - 1) / pr * dxd / pc)
        t += 2 * (ALPHA * clog(pc) + BETA * (pc - 1) / pc * w / pr)
    return t


def eq3(net, p, b):
    return sum(3 * (ALPHA * clog(p) + BETA * b * (p - 1) / p * x.d_out) for x in net if not isinstance(x, Pool2d))


def eq4(net, p):
    return sum(2 * (ALPHA * clog(p) + BETA * (p - 1) / p * x.n_params) for x in net if not isinstance(x, Pool2d))


NETS = {"alexnet": alexnet(), "mlp": mlp([784, 1000, 513, 10])}


@pytest.mark.parametrize("net", NETS)
@pytest.mark.parametrize("p", [1, 2, 6, 64])
def test_pc1_is_eq3_and_pr1_is_eq4(net, p):
    layers, b = NETS[net], 256
    assert total(network_phases(layers, p, 1, b, M, convention="paper")) == pytest.approx(eq3(layers, p, b))
    assert total(network_phases(layers, 1, p, b, M, convention="paper")) == pytest.approx(eq4(layers, p))


@pytest.mark.parametrize("net", NETS)
@pytest.mark.parametrize("pr, pc", [(2, 3), (4, 16), (8, 8), (16, 4), (3, 5)])
def test_grid_is_eq8(net, pr, pc):
    layers, b = NETS[net], 512
    assert total(network_phases(layers, pr, pc, b, M, convention="paper")) == pytest.approx(eq8(layers, pr, pc, b))
    assert total(network_phases(layers, pr, pc, b, M, convention="paper", dx_size="exact")) == pytest.approx(
        eq8(layers, pr, pc, b, dx="exact"))


def test_paper_first_layer_has_dx_engine_first_layer_does_not():
    layers = mlp([10, 20, 5])
    paper = network_phases(layers, 2, 2, 8, M, convention="paper")
    engine = network_phases(layers, 2, 2, 8, M)
    assert [p.phase for p in paper if p.layer == "fc1"] == ["fwd_gather", "dx_allreduce", "dw_allreduce"]
    assert "dx_reduce" not in [p.phase for p in engine if p.layer == "fc1"]
    assert "dx_reduce" in [p.phase for p in engine if p.layer == "fc2"]


def test_engine_weight_phases_equal_ring_allreduce_bandwidth():
    """dw_reduce + w_gather = Eq. 8's 2*(Pc-1)/Pc*|W|/Pr per process (even split)."""
    fc = FC(63, 16)  # 64 columns with the bias
    pr, pc = 4, 8
    eng = [p for p in dense_layer_phases(fc, pr, pc, 32, M, first_layer=True) if p.phase in ("dw_reduce", "w_gather")]
    per_process = sum(p.max_bytes_per_process for p in eng)
    assert per_process == 2 * (pc - 1) / pc * fc.n_params / pr * WB


# ---------------------------------------------------------------- conv: halo, Eq. 5, Eq. 6, Eq. 7


def test_halo_is_zero_for_1x1_kernels():
    conv = Conv2d(56, 56, 64, 256, 1, 1, bias=False)
    for conv_ in ("engine", "paper"):
        ph = {p.phase: p for p in domain_layer_phases(conv, 4, 2, 32, M, convention=conv_)}
        assert ph["halo_fwd"].seconds == 0 and ph["halo_bwd"].seconds == 0
        assert ph["halo_fwd"].total_bytes == 0 and ph["halo_fwd"].messages == 0


def test_domain_paper_closed_form_eq7_eq9():
    conv = Conv2d(27, 27, 96, 256, 5, 5, padding=2, bias=False)
    pr, pc, b = 4, 8, 64
    p = pr * pc
    expected = (
        ALPHA + BETA * b / pc * conv.in_w * conv.in_c * 2  # floor(5/2) = 2 halo rows, forward
        + ALPHA + BETA * b / pc * conv.out_w * conv.out_c * 2  # backward
        + 2 * (ALPHA * clog(p) + BETA * (p - 1) / p * conv.n_params)
    )
    assert total(domain_layer_phases(conv, pr, pc, b, M, convention="paper")) == pytest.approx(expected)
    # engine: interior slabs talk to two neighbours
    eng = {x.phase: x for x in domain_layer_phases(conv, pr, pc, b, M)}
    assert eng["halo_fwd"].messages == 2
    assert eng["halo_fwd"].total_bytes == 2 * (pr - 1) * 2 * conv.in_w * conv.in_c * b * WB


@pytest.mark.parametrize("conv", [Conv2d(13, 13, 256, 384, 3, 3, padding=1, bias=False),
                                  Conv2d(27, 27, 96, 256, 5, 5, padding=2, bias=False),
                                  Conv2d(6, 6, 512, 64, 3, 3, bias=False)])
def test_eq5_crossover(conv):
    """Batch beats model exactly when B > 2*k_h*k_w*X_C / (3*Y_H*Y_W)."""
    b_star = batch_model_crossover(conv)
    assert b_star == pytest.approx(2 * conv.k_h * conv.k_w * conv.in_c / (3 * conv.out_h * conv.out_w))
    machine = Machine(alpha_s=0.0)
    p = 16
    for b in (max(1, math.floor(b_star * 0.9)), math.ceil(b_star * 1.1) + 1):
        batch = total(batch_layer_phases(conv, p, machine, convention="paper"))
        model = total(conv_model_phases(conv, p, 1, b, machine, first_layer=False, convention="paper"))
        assert (batch < model) == (b > b_star)
        ratio = 2 * conv.k_h * conv.k_w * conv.in_c / (3 * b * conv.out_h * conv.out_w)
        assert batch / model == pytest.approx(ratio)


@pytest.mark.parametrize("p", [2, 8, 64, 100])
def test_redistribution_is_a_third_of_a_model_parallel_layer(p):
    fc = FC(4096, 4096)
    b = 256
    layer = total(dense_layer_phases(fc, p, 1, b, M, first_layer=False, convention="paper"))
    redist = redistribute_phase(fc.d_out, p, 1, b, M, convention="paper")
    assert redist.seconds == pytest.approx(ALPHA * clog(p) + BETA * b * (p - 1) / p * fc.d_out)
    assert redist.seconds == pytest.approx(layer / 3)


def test_redistribution_engine_total_bytes():
    ph = redistribute_phase(100, 3, 2, 10, M)
    assert ph.total_bytes == (3 - 1) * 100 * 10 * WB and ph.messages == 2


# ---------------------------------------------------------------- memory


def test_memory_of_a_dense_layer_by_hand():
    fc = FC(99, 40)  # |W| = 40*100 = 4000
    pr, pc, b = 4, 3, 10
    mem = layer_memory_bytes(fc, "model", pr, pc, b, M)
    assert mem.weights == (math.ceil(4000 / 12) + 10 * 100) * WB
    assert mem.gradients == (10 * 100 + math.ceil(4000 / 12)) * WB
    assert mem.optimizer == math.ceil(4000 / 12) * WB
    assert mem.activations == math.ceil(b / pc) * 40 * WB
    paper = layer_memory_bytes(fc, "model", pr, pc, b, M, convention="paper")
    assert paper.weights == paper.gradients == paper.optimizer == 1000 * WB


# ---------------------------------------------------------------- properties


layer_st = st.one_of(
    st.builds(FC, st.integers(1, 5000), st.integers(1, 5000), st.booleans()),
    st.builds(lambda h, c, o, k: Conv2d(h, h, c, o, k, k, padding=k // 2), st.integers(8, 64), st.integers(1, 64),
              st.integers(1, 64), st.sampled_from([1, 3, 5])),
)


def all_phases(layer, pr, pc, b, machine, convention):
    out = batch_layer_phases(layer, pr * pc, machine, convention=convention)
    if isinstance(layer, FC):
        out += dense_layer_phases(layer, pr, pc, b, machine, first_layer=False, convention=convention)
    else:
        out += conv_model_phases(layer, pr, pc, b, machine, first_layer=False, convention=convention)
        if convention == "paper" or pr <= layer.out_h:  # the engine needs an output row per strip
            out += domain_layer_phases(layer, pr, pc, b, machine, convention=convention)
    out.append(redistribute_phase(layer.d_in, pr, pc, b, machine, convention=convention))
    out.append(redistribute_phase(layer.d_in, pr, pc, b, machine, convention=convention, kind="alltoall"))
    return out


@settings(max_examples=80, deadline=None)
@given(layer=layer_st, pr=st.integers(1, 32), pc=st.integers(1, 32), b=st.integers(1, 512),
       alpha=st.floats(0, 1e-3), bw=st.floats(1e6, 1e12), k=st.floats(1.0, 10.0),
       convention=st.sampled_from(["engine", "paper"]))
def test_costs_nonnegative_and_monotone_in_alpha_and_inverse_bandwidth(layer, pr, pc, b, alpha, bw, k, convention):
    base = Machine(alpha_s=alpha, bandwidth_Bps=bw)
    slower_latency = Machine(alpha_s=alpha * k + 1e-9, bandwidth_Bps=bw)
    slower_bandwidth = Machine(alpha_s=alpha, bandwidth_Bps=bw / k)
    p0 = all_phases(layer, pr, pc, b, base, convention)
    p1 = all_phases(layer, pr, pc, b, slower_latency, convention)
    p2 = all_phases(layer, pr, pc, b, slower_bandwidth, convention)
    for a, x, y in zip(p0, p1, p2):
        for v in (a.total_bytes, a.max_bytes_per_process, a.messages, a.latency_s, a.bandwidth_s):
            assert v >= 0
        assert x.seconds >= a.seconds and y.seconds >= a.seconds
        assert a.total_bytes == x.total_bytes == y.total_bytes
    mem = layer_memory_bytes(layer, "model", pr, pc, b, base, convention=convention)
    assert min(mem.weights, mem.gradients, mem.optimizer, mem.activations) >= 0


# ---------------------------------------------------------------- no dask


def test_importing_cost_model_does_not_import_dask():
    code = (
        "import sys; import dask_ipar.cost, dask_ipar.cli.plan; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('dask', 'distributed')); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_replica_words_follow_the_engines_blocks():
    """Each cell's replicated state: its weight block (outputs over Pr, inputs plus the bias
    column over Pc; a grouped conv's inputs are C / groups * kh * kw) times 1 + slots."""
    from dask_ipar.cost import FC, Conv2d, Pool2d
    from dask_ipar.cost.replica import network_state_words, replica_memory_bytes

    conv = Conv2d(in_h=8, in_w=8, in_c=4, out_c=8, k_h=3, k_w=3, groups=2)
    words = network_state_words([conv, Pool2d(in_h=8, in_w=8, channels=8, k=2)], 1, 2, 1)
    assert words == {(0, 0): 8 * 10 * 2, (0, 1): 8 * 9 * 2}  # 4/2*9 + 1 = 19 -> 10 + 9
    words = network_state_words([FC(7, 9), FC(9, 5)], 2, 2, 2)  # Adam: 2 slots
    assert words[(0, 0)] == (5 * 4 + 3 * 5) * 3 and sum(words.values()) == (9 * 8 + 5 * 10) * 3
    # busiest process: its own cell and its buddy's (cell (i+1, j) holds cell (i, j)'s)
    assert replica_memory_bytes(words, 2, 2, 4) == 2 * 4 * max(
        words[(i, j)] + words[((i + 1) % 2, j)] for i in range(2) for j in range(2))
