"""gpu/standin.py and gpu/timing.py: the stand-in device rejects what a GPU would reject or
get wrong (grid and block limits, argument types, float4 alignment, stale pointer tables),
flags host waits inside a timed region, and models one stream so that Timer's numbers hold
together; the hierarchy kernels' results are checked, and a defect planted in each (a chase
replaying its start, a read that never ran) is caught.

All slow: the fixture builds eight kernel files and each stand-in module is one more g++
build (~0.6 s each, ~6 s for the file on a fresh kernel cache)."""


import numpy as np
import pytest

from minidist.gpu import fused, hierarchy as h
from minidist.gpu.emulate.build import build_many, compiler_missing
from minidist.gpu.standin import StandIn, StandInError
from minidist.gpu.timing import Timer

pytestmark = [pytest.mark.skipif(compiler_missing() is not None,
                                 reason=f"the CPU emulator cannot build: {compiler_missing()}"),
              pytest.mark.slow]


@pytest.fixture(scope="module")
def dev():
    build_many(["layernorm.cu", "cross_entropy.cu", "adamw.cu", "flash_attention.cu",
                "hold.cu", "pointer_chase.cu", "bandwidth.cu", "sgemm_6_vectorized.cu"])
    return fused.CupyDevice(StandIn())


def _x(dev, *shape):
    return dev.asarray(np.random.default_rng(0).standard_normal(shape).astype(np.float32))


def test_a_kernel_runs_through_cupy_device_on_the_stand_in_and_is_looked_up_once(dev):
    x, w, b = _x(dev, 5, 40), dev.cp.ones(40, np.float32), dev.cp.zeros(40, np.float32)
    for _ in range(3):
        y, mean, _ = fused.layernorm_forward(dev, x, w, b)
    assert np.allclose(dev.to_numpy(mean), dev.to_numpy(x).mean(axis=1), atol=1e-6)
    assert [n for (path, k), n in dev.cp.lookups.items() if k == "layernorm_forward"] == [1]


def test_launch_limits_and_argument_types_are_checked(dev):
    fn, _ = dev.function("layernorm.cu", "layernorm_forward")
    x = _x(dev, 2, 8)
    v = dev.cp.zeros(8, np.float32)
    good = (x, v, v, x.copy(), v[:2].copy(), v[:2].copy(), np.int32(2), np.int32(8),
            np.float32(1e-5))
    with pytest.raises(StandInError, match=r"grid \(1, 65536, 1\) exceeds CUDA's limits"):
        fn((1, 65536, 1), (32, 1, 1), good)
    with pytest.raises(StandInError, match="exceeds 1024 threads"):
        fn((1, 1, 1), (64, 32, 1), good)
    with pytest.raises(StandInError, match=r"argument 'eps' \(float\) needs a NumPy float32 "
                                           r"scalar .* got float64"):
        fn((1, 1, 1), (32, 1, 1), good[:8] + (np.float64(1e-5),))
    with pytest.raises(StandInError, match="9 parameters"):
        fn((1, 1, 1), (32, 1, 1), good[:8])
    with pytest.raises(ValueError, match=r"argument 'N' = 2147483648 does not fit the "
                                         r"kernel's int"):
        dev.launch("layernorm.cu", "layernorm_forward", 1, 32, good[:6] + (2 ** 31, 8, 1e-5))


def test_float4_kernels_need_16_byte_aligned_arrays(dev):
    rung = next(r for r in h.EMULATED if r.kernel == "sgemm_vec_32x32x8_4x4")
    A, B = _x(dev, 8, 8), _x(dev, 8, 9)
    C = dev.cp.zeros((8, 8), np.float32)
    B_off = B[:, 1:].copy().ravel()[:64].reshape(8, 8)             # a fresh, aligned copy
    dev.launch(rung.file, rung.kernel, *rung.dims(8, 8), h.sgemm_args(8, 8, 8, 1.0, A, B_off,
                                                                    0.0, C))
    assert np.allclose(dev.to_numpy(C), dev.to_numpy(A) @ dev.to_numpy(B_off), atol=1e-5)
    shifted = dev.cp.zeros(65, np.float32)[1:].reshape(8, 8)       # starts 4 bytes in
    with pytest.raises(StandInError, match="not a multiple of 16 bytes"):
        dev.launch(rung.file, rung.kernel, *rung.dims(8, 8),
                   h.sgemm_args(8, 8, 8, 1.0, A, shifted, 0.0, C))


def test_a_pointer_table_must_point_at_live_device_arrays(dev):
    ps = [dev.cp.zeros(10, np.float32) for _ in range(2)]
    table = fused.ChunkTable(dev, ps, ps, ps, ps)
    fused.adamw_multi_tensor(dev, ps, ps, ps, ps, lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, wd=0.0,
                             t=1, table=table)
    host = [np.zeros(10, np.float32) for _ in range(2)]           # not on the device
    with pytest.raises(StandInError, match="table entry .* is not the address of an array"):
        fused.adamw_multi_tensor(dev, host, host, host, host, lr=1e-3, b1=0.9, b2=0.95,
                                 eps=1e-8, wd=0.0, t=1)


def test_flash_attention_refuses_more_heads_than_the_grid_holds(dev):
    q = dev.cp.zeros((65536, 1, 4), np.float32)
    with pytest.raises(ValueError, match="65536 heads .* exceed the grid's y limit of 65535"):
        fused.flash_attention_forward(dev, q, q, q)


def test_a_host_copy_inside_a_timed_call_is_caught_and_count_keeps_it_out(dev):
    """The first GPU run's cross-entropy copied its targets to the host on every call."""
    z, t = _x(dev, 4, 30), dev.asarray(np.array([1, 2, -100, 4], np.int32))
    timer = Timer(dev, calls=2, repeats=1)
    with pytest.raises(StandInError, match="host wait.* asnumpy \\(a device->host copy\\)"):
        timer.ms(lambda: fused.cross_entropy(dev, z, t))
    count, _ = fused.ce_setup(dev, t, 30, "mean", -100)
    assert count == 3
    assert timer.ms(lambda: fused.cross_entropy(dev, z, t, count=count)) > 0
    assert timer.last.hidden and timer.last.calls == 2


def test_timer_brackets_queued_kernels_and_says_when_the_host_outran_the_hold(dev):
    """Launches only: hidden, and the time is the modeled kernels' (2 us + bytes / 4 TB/s
    each). Host work longer than the hold (capped at 0.01 ms here) cannot be hidden."""
    x = dev.cp.zeros(1 << 16, np.float32)
    timer = Timer(dev, calls=3, repeats=2)

    def copy():
        dev.launch("bandwidth.cu", "bandwidth_copy", 4, 64, (x, x, x.size // 4))
    got = timer.time(copy)
    assert got.hidden and got.ms == pytest.approx((2e-6 + 2 * x.nbytes / 4e12) * 1e3)
    slow = Timer(dev, calls=3, repeats=1, max_hold_ms=0.01)
    assert not slow.time(lambda: (dev.cp.charge_host(0.002), copy())).hidden   # 2 ms host work


def test_the_pointer_chase_walks_on_round_its_cycle_and_is_checked(dev, monkeypatch):
    rows = h.gpu_latency((8 << 10, 64 << 10), hops=100, dev=dev, timer=Timer(dev, 2, 1))
    assert [size for size, _ in rows] == [8 << 10, 64 << 10] and all(ns > 0 for _, ns in rows)
    monkeypatch.setattr(h, "CONTINUE", 0)          # the first run's defect: restart at slot 0
    with pytest.raises(h.ResultError, match="the host's walk of the same cycle ends at"):
        h.gpu_latency((64 << 10,), hops=100, dev=dev, timer=Timer(dev, 2, 1))


def test_the_bandwidth_kernels_results_are_checked(dev, monkeypatch):
    rows = h.gpu_bandwidth((16 << 10, 64 << 10), loads=1 << 10, dev=dev, timer=Timer(dev, 1, 1))
    assert len(rows) == 3 and all(gbs > 0 for _, gbs in rows)
    launch = dev.launch
    monkeypatch.setattr(dev, "launch", lambda cu, k, *a, **kw: None if k == "bandwidth_read"
                        else launch(cu, k, *a, **kw))            # a read that never ran
    with pytest.raises(h.ResultError, match="bandwidth_read over 16384 B: the threads' sums"):
        h.gpu_bandwidth((16 << 10,), loads=1 << 10, dev=dev, timer=Timer(dev, 1, 1))
