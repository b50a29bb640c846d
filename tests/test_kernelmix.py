"""The kernel mix behind the calibrated element-wise rate (``dask_ipar.runtime.kernelmix``)."""

from __future__ import annotations

import numpy as np
import pytest

from dask_ipar.kernels.costs import kernel_cost, kernel_kind
from dask_ipar.runtime.kernelmix import (
    LARGE_IMAGES,
    MixRun,
    elementwise_rate,
    kernel_calls,
    kernel_mix,
    mix_rates,
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
    # each conv call timed inside the whole run's window; the products' edge counted
    assert 0 < one.conv_seconds < s1 and 0 < three.conv_seconds < s3
    assert three.edge == pytest.approx(3 * one.edge) and one.edge > 0
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


def test_the_large_runs_rates_make_the_model_time_equal_the_measured_times():
    """``dask-ipar calibrate``'s two element-wise rates from one run of the mix on 16 MiB
    blocks: the whole mix's (``elementwise_Bps``, its products' flops with their edge at
    ``gemm_edge_flops``) and its conv and pooling calls' alone (``conv_Bps``). A run timed as
    the model would time it at known rates gives them back."""
    calls = kernel_calls("float32", LARGE_IMAGES)
    assert calls[0][1][0].nbytes == 16 * 2**20
    f = edge = mem = cf = cedge = cmem = 0.0
    for fn, args in calls:  # the cost model's terms, call by call
        _, fl, mb, e = kernel_cost(fn, args, lambda v: tuple(v.shape)
                                   if isinstance(v, np.ndarray) else None, 4)
        f, edge, mem = f + fl, edge + e, mem + mb
        if kernel_kind(fn) == "conv":
            cf, cedge, cmem = cf + fl, cedge + e, cmem + mb
    assert cedge == 0 and 0 < cf < f and 0.9 * mem < cmem < mem and edge > 0
    rate, dense, conv, e, k = 1e11, 2.0e10, 0.8e10, 30.0, 2
    conv_s = k * (cf / rate + cmem / conv)
    dense_s = k * ((f - cf + e * edge) / rate + (mem - cmem) / dense)
    run = MixRun(k * f, k * mem, conv_s + dense_s, k * cf, k * cmem, conv_s, k * edge)
    whole, got_conv = mix_rates(run, rate, edge_flops=e)
    assert got_conv == pytest.approx(conv)
    # the whole mix's: its bytes over their time, between the conv front's and the rest's
    assert k * mem / whole == pytest.approx(run.seconds - k * (f + e * edge) / rate)
    assert conv < whole < dense
    # the edge unpriced: the products' edge counted as element-wise time, a slower rate
    assert mix_rates(run, rate)[0] < whole
    # the flops take the conv calls' whole time: not measured
    assert mix_rates(run._replace(conv_seconds=k * cf / rate), rate, edge_flops=e)[1] is None
