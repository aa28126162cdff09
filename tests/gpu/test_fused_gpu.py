"""The fused ops on a real GPU (CuPy arrays, kernels compiled by NVRTC): the emulator's cases
run unchanged on a CupyDevice against the same float64 twins, plus flash attention at the
issue's size. Marked gpu: skipped without CuPy and a CUDA device. Without them, CupyDevice
says so in one error that names the CPU alternative."""

from __future__ import annotations

import numpy as np
import pytest

from minidist import backend
from minidist.gpu import fused, twins
from minidist.gpu.emulate.cases import CASES, TOL_ATTENTION, rel_error, run_case

GPU_PROBLEM = backend.gpu_problem()
needs_gpu = pytest.mark.skipif(GPU_PROBLEM is not None, reason=f"no GPU: {GPU_PROBLEM}")
PARAMS = [(name, shape, block) for name, (_, shapes, blocks) in CASES.items()
          for shape in shapes for block in blocks]


@pytest.fixture(scope="module")
def gpu():
    return fused.CupyDevice()


def test_without_a_gpu_the_cupy_device_names_the_cpu_alternative():
    if GPU_PROBLEM is None:
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match=r"needs CuPy and a CUDA device: .*Emulator\(\)"):
        fused.CupyDevice()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name,shape,block", PARAMS,
                         ids=[f"{n}-{'x'.join(map(str, s))}-b{b}" for n, s, b in PARAMS])
def test_fused_op_on_the_gpu_matches_its_twin(gpu, name, shape, block):
    checks = run_case(name, gpu, shape, block)
    bad = [str(c) for c in checks if not c.ok]
    assert not bad, f"{name} at {shape}, block {block} on the GPU:\n" + "\n".join(bad)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attention_at_t2048_d64_matches_the_plain_formula(gpu, causal):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 2048, 64)).astype(np.float32) for _ in range(3))
    o, lse = fused.flash_attention_forward(gpu, *(gpu.asarray(a) for a in (q, k, v)),
                                           causal=causal, block=128)
    want = twins.attention(q, k, v, causal=causal)
    assert rel_error(gpu.to_numpy(o), want["o"]) <= TOL_ATTENTION
    assert rel_error(gpu.to_numpy(lse), want["lse"]) <= TOL_ATTENTION
    assert [r.kernel for r in gpu.launches[-1:]] == ["flash_attention_forward"]
