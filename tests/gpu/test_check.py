"""gpu/check.py, the script a lent GPU runs, tested without one: the one-line skip, that it
needs neither multiprocess nor dill, the verdict lines, and the training part's comparison
run end to end with NumPy standing in for CuPy (the GPU run itself is marked gpu).

Default set: the skip lines, the verdicts and the training part on NumPy. Slow: the
subprocess import check and every part run on the stand-in (its fixture builds eight kernel
files, and each stand-in module is one more g++ build)."""

import os
import subprocess
import sys
import types

import numpy as np
import pytest

from minidist import backend
from minidist.gpu import check

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_without_a_gpu_it_prints_one_line_and_exits_3(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cupy", None)             # as if CuPy were missing
    assert check.main([]) == check.EXIT_NO_GPU == 3
    out = capsys.readouterr().out.splitlines()
    assert out == ["gpu check: skipped, nothing was checked (CuPy is not installed); it needs "
                   "CuPy (the 'gpu' extra: CUDA 13) and a CUDA device. `--dry-run` runs it on "
                   "a stand-in."]


def test_cupy_without_its_cuda_libraries_is_its_own_exit_code(monkeypatch, capsys):
    """A CuPy whose import fails on a missing CUDA library is not "CuPy is not installed"."""
    import builtins
    real_import = builtins.__import__

    def failing(name, *args, **kwargs):
        if name == "cupy":
            raise ImportError("libcudart.so.13: cannot open shared object file")
        return real_import(name, *args, **kwargs)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.setattr(builtins, "__import__", failing)
    assert check.main([]) == check.EXIT_NO_CUDA_LIBRARIES == 4
    out = capsys.readouterr().out
    assert out.startswith("gpu check: CuPy is installed but cannot use CUDA here (ImportError: "
                          "libcudart.so.13"), out
    assert "cupy-cuda13x[ctk]" in out


@pytest.mark.slow
def test_it_needs_neither_multiprocess_nor_dill():
    """A fresh interpreter where importing either fails: the module, the modules its parts
    import, the skip path and the training part (NumPy for CuPy) all still work."""
    code = (
        "import sys\n"
        "sys.modules['multiprocess'] = sys.modules['dill'] = None\n"
        "sys.modules['cupy'] = None\n"
        "from minidist.gpu import check\n"
        "import minidist.gpu.hierarchy, minidist.gpu.fused, minidist.gpu.unfused\n"
        "import minidist.gpu.emulate.cases, minidist.hardware.op_costs, minidist.baseline\n"
        "import minidist.autograd.fused, minidist.optim.adamw, minidist.hardware.roofline\n"
        "assert check.main([]) == 3\n"
        "import numpy\n"
        "part = check.training(check.Rig(numpy, None, 'numpy'), steps=1, batch=4)\n"
        "print(part.line())\n"
        "assert 'multiprocess' not in sys.modules or sys.modules['multiprocess'] is None\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0].startswith("gpu check: skipped, nothing was checked (CuPy "
                                                  "is not installed)")
    assert done.stdout.splitlines()[-1].startswith("OK: training: 1 steps on numpy: float64 "
                                                   "max |GPU - CPU| = 0.0e+00"), done.stdout


def test_training_part_compares_both_dtypes_against_the_cpu_float64_run():
    part = check.training(check.Rig(np, None, "numpy"), steps=2, batch=4)
    assert part.ok, part.line()
    assert [row.split(" losses ")[0].strip() for row in part.rows] == [
        "CPU float64", "numpy float64", "CPU float32", "numpy float32"]
    assert backend.xp is np                                    # the numpy backend is back


KB = 1 << 10
TINY = dict(N=7, C=100, BH=2, T=45, D=16, V=50, NV=9, cases="one",
            gpt=dict(vocab_size=11, block_size=12, n_layer=1, n_head=2, n_embd=8),
            ladder_n=32, working_sets=tuple(4 * KB << i for i in range(11)), hops=256,
            bandwidth_set=64 * KB, loads=1 << 12, calls=1, repeats=1)


@pytest.fixture(scope="module")
def standin_rig():
    """The parts' Rig on gpu/standin.py: CupyDevice on a StandIn (NumPy for CuPy, the CPU
    emulator for the GPU, every launch checked), at TINY sizes; built once."""
    from minidist.gpu.emulate.build import build_many, compiler_missing
    if compiler_missing() is not None:
        pytest.skip(f"the CPU emulator cannot build: {compiler_missing()}")
    build_many(["layernorm.cu", "bias_gelu.cu", "softmax.cu", "cross_entropy.cu", "adamw.cu",
                "flash_attention.cu", "unfused.cu", "hold.cu"])
    return check.stand_in_rig(TINY)


def _looked_up_once(rig):
    lookups = rig.device.cp.lookups
    assert lookups and max(lookups.values()) == 1, {k[1]: n for k, n in lookups.items() if n > 1}


@pytest.mark.slow
def test_kernels_part_runs_every_case_on_the_stand_in(standin_rig):
    part = check.run_part("kernels", standin_rig)
    assert part.ok, "\n".join(part.rows + [part.line()])
    names = {row.split()[0] for row in part.rows}
    assert {"layernorm_forward", "bias_gelu_backward", "softmax_backward", "cross_entropy",
            "adamw", "flash_attention"} <= names, part.rows
    assert "flash_attention T=45 D=16" in "\n".join(part.rows)
    _looked_up_once(standin_rig)


@pytest.mark.slow
def test_fusion_part_times_each_op_three_ways_with_no_host_wait(standin_rig):
    """Every op's three versions run with the arguments the GPU run gives them, timed by the
    Timer with no host wait inside a timed region (the stand-in raises on one); the
    predicted speedup is the roofline's: for a memory-bound op, its byte ratio."""
    from minidist.hardware import op_costs as oc
    part = check.run_part("fusion", standin_rig)
    assert not part.summary.startswith("raised"), part.line()
    names = [row[2:28].strip() for row in part.rows[1:]]
    assert names == ["layernorm forward", "layernorm backward", "bias + gelu forward",
                     "bias + gelu backward", "causal softmax", "causal softmax backward",
                     "cross-entropy + grad", "adamw (16 tensors)", "attention T=45 D=16"]
    fused, unfused = oc.layernorm(TINY["N"], TINY["C"], 4)
    ratio = sum(k.bytes for k in unfused) / fused[0].bytes
    assert part.rows[1].split()[6:8] == [f"{ratio:.1f}x", "1/10"], part.rows[1]
    assert part.rows[8].split()[8] == f"1/{14 * 16}", part.rows[8]      # 14 passes a tensor
    _looked_up_once(standin_rig)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bandwidth", "ladder", "hierarchy", "training"])
def test_bandwidth_ladder_hierarchy_and_training_parts_run_on_the_stand_in(standin_rig, name):
    """The parts no CPU test ran before (the first GPU run found bandwidth's ImportError):
    each reaches its verdict line; the hierarchy's modeled levels give its OK."""
    part = check.run_part(name, standin_rig)
    assert not part.summary.startswith("raised"), part.line()
    assert not part.context_lost
    if name == "ladder":
        assert [r.split()[0] for r in part.rows[1:]] == list("1234567") + ["cuBLAS"]
        assert all(float(r.split()[-1]) <= 1e-4 for r in part.rows[1:]), part.rows
        assert "% of the 66.9 TFLOP/s FP32 peak" in part.summary
    if name in ("hierarchy", "training"):
        assert part.ok, part.line()


@pytest.mark.slow
def test_a_sticky_cuda_error_stops_the_run_naming_its_part(standin_rig, capsys):
    """A fault planted in fusion's first kernel: fusion reports the CUDA error (its closing
    synchronize surfaces it), the context is lost, and no later part runs under its name."""
    from minidist.gpu.standin import CUDARuntimeError
    rig = check.stand_in_rig(TINY)
    rig.device.cp.plant_fault("layernorm_forward")
    results = check.run_parts(["training", "fusion", "bandwidth", "ladder"], rig)
    out = capsys.readouterr().out
    assert [r.name for r in results] == ["training", "fusion"], out
    assert results[0].ok and not results[1].ok and results[1].context_lost
    assert "raised CUDARuntimeError: cudaErrorIllegalAddress" in results[1].summary
    assert ("gpu check: stopped after fusion: the CUDA context is lost" in out
            and "Not run: bandwidth, ladder" in out
            and "python -m minidist gpu check --parts bandwidth,ladder" in out), out
    with pytest.raises(CUDARuntimeError):                          # sticky: everything fails
        rig.device.cp.zeros(3)


def test_gap():
    a = (np.array([1.0, 2.0]), {"w": np.array([0.5, 0.25])})
    b = (np.array([1.0, 2.5]), {"w": np.array([0.5, 0.0])})
    assert check.gap(a, b) == 0.5
    assert check.gap(a, (a[0], {"w": np.array([0.5, 1.25])})) == 1.0


def test_latency_verdict_fails_the_flat_curve_of_the_first_h200_run():
    """The first H200 run: 20 ns to 128 KB, then 145-153 ns from 512 KB to 1 GB (every set
    served from L2, as the chase replayed the same first hops). It said OK; it must not."""
    MB = 1 << 20
    ns = [20.2, 20.3, 20.5, 21.0, 86.7] + [145.1, 145.2, 145.3, 145.2, 145.3, 145.3, 145.3,
                                           146.6, 147.7, 147.9, 151.0, 152.8]
    flat = list(zip((16 * KB << i for i in range(17)), ns))
    ok, why = check.latency_verdict(flat, 50 * MB)
    assert not ok and "145 ns (L2/16 .. L2/4) -> 151 ns (>= 4 x L2 = 200 MB)" in why, why
    rising = flat[:-3] + [(s, 600.0) for s, _ in flat[-3:]]
    assert check.latency_verdict(rising, 50 * MB)[0]
    assert not check.latency_verdict(flat[:10], 50 * MB)[0]        # never beyond 4 x L2


def test_verdict_lines_exit_code_and_a_part_that_raises(monkeypatch, capsys):
    fake = types.SimpleNamespace(__version__="0.0-test")
    monkeypatch.setattr(check, "gpu_status", lambda: (fake, "", 0))
    monkeypatch.setattr(check, "describe", lambda cp: "a test device")
    from minidist.gpu import fused
    monkeypatch.setattr(fused, "CupyDevice", lambda: None)

    def broken(cp):
        raise RuntimeError("kernel launch failed:\n  out of resources")
    monkeypatch.setattr(check, "PARTS", {"good": lambda cp: check.Part("good", True, "fine"),
                                         "broken": broken})
    assert check.main([]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "gpu check · a test device"
    assert any(line.startswith("OK: good: fine [") for line in out)
    assert any(line.startswith("MISMATCH: broken: raised RuntimeError: kernel launch failed: "
                               "out of resources [") for line in out)
    assert out[-1] == "gpu check: 1 of 2 parts OK; MISMATCH in broken"
    assert check.main(["--parts", "good"]) == 0
    with pytest.raises(SystemExit) as e:
        check.main(["--parts", "good,nope"])
    assert e.value.code == 2


@pytest.mark.slow
def test_dry_run_prints_the_full_report_with_every_part_reached():
    """`python -m minidist gpu check --dry-run`: the whole script on the stand-in (~40 s)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-m", "minidist", "gpu", "check", "--dry-run"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    for name in check.PARTS:
        assert f"\n== {name} ==\n" in out, out
    assert "OK: kernels: " in out and "OK: hierarchy: " in out and "OK: training: " in out
    assert "gpu check --dry-run: 6 of 6 parts ran" in out.splitlines()[-1]


@pytest.mark.gpu
def test_the_whole_check_on_a_gpu():
    if check.find_gpu()[0] is None:
        pytest.skip("needs CuPy and a CUDA device")
    assert check.main([]) == 0
