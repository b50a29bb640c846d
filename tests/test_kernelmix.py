"""The kernel mix behind the calibrated element-wise rate (``dask_ipar.runtime.kernelmix``)."""

from __future__ import annotations

import numpy as np
import pytest

from dask_ipar.kernels.costs import kernel_cost, kernel_kind
from dask_ipar.runtime.kernelmix import (
    IMAGES,
    LARGE_IMAGES,
    MixRun,
    conv_rates,
    elementwise_rate,
    elementwise_rates,
    kernel_calls,
    kernel_mix,
    mix_rates,
    mix_split,
)

pytestmark = pytest.mark.fast


def test_the_mix_counts_its_kernels_model_costs_and_times_them():
    one, three = kernel_mix(1), kernel_mix(3)
    flops1, mem1, s1 = one[:3]
    flops3, mem3, s3 = three[:3]
    assert flops3 == pytest.approx(3 * flops1) and mem3 == pytest.approx(3 * mem1)
    assert 0 < s1 and 0 < s3
    # the counts are the cost model's own, call by call, as the simulator charges a task;
    # the conv front's calls (conv and pooling blocks, forward and backward) apart
    want = {"": [0.0, 0.0], "conv": [0.0, 0.0]}
    for f, args in kernel_calls("float32"):
        _, fl, mb, _ = kernel_cost(f, args, lambda v: tuple(v.shape)
                                if isinstance(v, np.ndarray) else None, 4)
        want[kernel_kind(f)][0] += fl
        want[kernel_kind(f)][1] += mb
    assert [f.__name__ for f, _ in kernel_calls("float32") if kernel_kind(f) == "conv"] == [
        "conv_block", "conv_block_backward", "pool_block", "pool_block_backward"]
    assert (flops1, mem1) == pytest.approx((want[""][0] + want["conv"][0],
                                            want[""][1] + want["conv"][1]))
    assert (one.conv_flops, one.conv_mem_bytes) == pytest.approx(want["conv"])
    assert (three.conv_flops, three.conv_mem_bytes) == pytest.approx(
        (3 * want["conv"][0], 3 * want["conv"][1]))
    # each conv call timed inside the whole run's window
    assert 0 < one.conv_seconds < s1 and 0 < three.conv_seconds < s3
    # the mix is mostly element-wise work: the conv, pooling and short dense kernels
    assert mem1 > 1e8 and flops1 > 1e8


def test_elementwise_rate_makes_the_model_time_equal_the_measured_time():
    flops, mem, seconds, rate = 1e9, 2e9, 0.5, 2e10
    for speed in (1.0, 0.25):
        e = elementwise_rate(flops, mem, seconds, rate, speed)
        # the simulator's time of the run at that share of the cores
        assert (flops / rate + mem / e) / speed == pytest.approx(seconds)
    # the flops alone take the whole time (or more): no rate can be read off
    assert elementwise_rate(flops, mem, flops / rate, rate) is None
    assert elementwise_rate(flops, mem, 0.5 * flops / rate, rate) is None


def test_two_sizes_of_the_mix_give_the_small_and_the_large_blocks_rates():
    # the mix's bytes by its calls' largest arrays: the 4 MiB conv block at the small
    # size, its dense forward's 16 MiB output at the large; the 16 MiB conv block all large
    f16, a16, b16 = mix_split("float32", IMAGES)
    f64, a64, b64 = mix_split("float32", LARGE_IMAGES)
    assert a16 > 2 * b16 > 0 and a64 == 0 and b64 > a16 + b16 and f64 > f16
    # runs timed as the model would time them at known rates: the rates come back
    rate, small, large = 1e11, 1.8e10, 1.5e10
    runs = [(f * k, (a + b) * k, f * k / rate + a * k / small + b * k / large)
            for (f, a, b), k in (((f16, a16, b16), 2), ((f64, a64, b64), 1))]
    assert elementwise_rates(*runs, rate) == pytest.approx((small, large))
    # no positive solution (the large run took less than its flops alone): one rate, the
    # small run's
    fast = (runs[1][0], runs[1][1], 0.9 * runs[1][0] / rate)
    assert elementwise_rates(runs[0], fast, rate) == (elementwise_rate(*runs[0], rate), None)
    # the large mix runs (its conv block on 16 MiB)
    assert kernel_calls("float32", LARGE_IMAGES)[0][1][0].nbytes == 16 * 2**20


def test_the_mix_solved_with_its_products_edge_priced():
    """With ``gemm_edge_flops`` the mix's products cost their flops and their edge's
    flop-equivalents (as the step model charges them); runs timed that way give the rates
    back, and the edge-free solve of the same runs reads the element-wise work slower."""
    e = 90.0
    f16, a16, b16 = mix_split("float32", IMAGES)
    f64, a64, b64 = mix_split("float32", LARGE_IMAGES)
    g16, g64 = (mix_split("float32", n, e)[0] for n in (IMAGES, LARGE_IMAGES))
    # the mix's dense kernels are thin products (64 rows): their edge costs time
    assert g16 > f16 and g64 - f64 == pytest.approx(g16 - f16)
    rate, small, large = 1e11, 1.8e10, 1.5e10
    runs = [(f * k, (a + b) * k, g * k / rate + a * k / small + b * k / large)
            for (f, g, a, b), k in (((f16, g16, a16, b16), 2), ((f64, g64, a64, b64), 1))]
    assert elementwise_rates(*runs, rate, edge_flops=e) == pytest.approx((small, large))
    plain = elementwise_rates(*runs, rate)
    assert plain[0] < small and plain[1] < large


def _timed(rate, small, large, conv=None):
    """Runs of the mix at its two sizes (2 rounds and 1) timed as the model would time them
    without a products' edge: the dense calls at ``small``/``large``, the conv front's at
    ``conv`` (the same where None)."""
    runs = []
    for images, k in ((IMAGES, 2), (LARGE_IMAGES, 1)):
        f, a, b = mix_split("float32", images)
        cf, ca, cb = _conv_split(images)
        cs, cl = conv or (small, large)
        conv_s = cf * k / rate + ca * k / cs + cb * k / cl
        rest_s = (f - cf) * k / rate + (a - ca) * k / small + (b - cb) * k / large
        runs.append(MixRun(f * k, (a + b) * k, conv_s + rest_s, cf * k, (ca + cb) * k, conv_s))
    return runs


def _conv_split(images):
    from dask_ipar.runtime.kernelmix import _split

    f, _, a, b = _split("float32", images, conv_only=True)
    return f, a, b


def test_the_conv_fronts_calls_give_their_own_rates():
    """The conv and pooling calls' time alone gives the conv front's two rates back
    (``conv_Bps``, ``conv_large_Bps``); the whole mix's rates come from the whole time, as
    before, and so fall between the conv front's and the dense kernels'."""
    rate, small, large, conv = 1e11, 2.4e10, 2.0e10, (0.9e10, 0.7e10)
    runs = _timed(rate, small, large, conv=conv)
    assert conv_rates(*runs, rate) == pytest.approx(conv)
    ew, ew_large, c, c_large = mix_rates(*runs, rate)
    assert (c, c_large) == pytest.approx(conv)
    assert conv[0] < ew < small and conv[1] < ew_large < large
    assert (ew, ew_large) == pytest.approx(elementwise_rates(*runs, rate))
    # one rate for all: the conv front reads it too
    same = _timed(rate, small, large)
    assert mix_rates(*same, rate) == pytest.approx((small, large, small, large))
    # no positive solution for two: the small run's conv calls alone give one rate
    r0, r1 = runs
    slow = r1._replace(conv_seconds=0.5 * r1.conv_flops / rate)
    assert conv_rates(r0, slow, rate) == (
        elementwise_rate(r0.conv_flops, r0.conv_mem_bytes, r0.conv_seconds, rate), None)
    # the flops alone take the conv calls' whole time: not measured
    assert conv_rates(r0._replace(conv_seconds=r0.conv_flops / rate), slow, rate) == (None, None)
