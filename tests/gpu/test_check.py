"""gpu/check.py, the script a lent GPU runs, tested without one: the one-line skip, that it
needs neither multiprocess nor dill, the verdict lines, and the training part's comparison
run end to end with NumPy standing in for CuPy (the GPU run itself is marked gpu)."""

import os
import subprocess
import sys
import types

import numpy as np
import pytest

from minidist import backend
from minidist.gpu import check

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_without_a_gpu_it_prints_one_line_and_exits_0(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cupy", None)             # as if CuPy were missing
    assert check.main([]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["gpu check: skipped (CuPy is not installed); it needs CuPy (the 'gpu' "
                   "extra: CUDA 13) and a CUDA device."]


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
        "assert check.main([]) == 0\n"
        "import numpy\n"
        "part = check.training(check.Rig(numpy, None, 'numpy'), steps=1, batch=4)\n"
        "print(part.line())\n"
        "assert 'multiprocess' not in sys.modules or sys.modules['multiprocess'] is None\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0].startswith("gpu check: skipped (CuPy is not installed)")
    assert done.stdout.splitlines()[-1].startswith("OK: training: 1 steps on numpy: float64 "
                                                   "max |GPU - CPU| = 0.0e+00"), done.stdout


def test_training_part_compares_both_dtypes_against_the_cpu_float64_run():
    part = check.training(check.Rig(np, None, "numpy"), steps=2, batch=4)
    assert part.ok, part.line()
    assert [row.split(" losses ")[0].strip() for row in part.rows] == [
        "CPU float64", "numpy float64", "CPU float32", "numpy float32"]
    assert backend.xp is np                                    # the numpy backend is back


TINY = dict(N=7, C=100, BH=2, T=45, D=16, V=50, NV=9, cases="one",
            gpt=dict(vocab_size=11, block_size=12, n_layer=1, n_head=2, n_embd=8))


@pytest.fixture(scope="module")
def emulator_rig():
    """The parts' Rig with NumPy for CuPy and the CPU emulator for the GPU (built once)."""
    from minidist.gpu.emulate.build import build_many, compiler_missing
    if compiler_missing() is not None:
        pytest.skip(f"the CPU emulator cannot build: {compiler_missing()}")
    from minidist.gpu.emulate.runner import Emulator
    build_many(["layernorm.cu", "bias_gelu.cu", "softmax.cu", "cross_entropy.cu", "adamw.cu",
                "flash_attention.cu", "unfused.cu"])
    class Once(check.Rig):
        """Runs each timed function once: on the emulator the times mean nothing, and the
        point is that every line of a part runs as it will on a GPU."""

        def ms(self, fn, repeats=5):
            fn()
            return 1.0
    return Once(np, Emulator(), "numpy", dict(TINY))


def test_kernels_part_runs_every_case_on_a_device(emulator_rig):
    part = check.kernels(emulator_rig)
    assert part.ok, "\n".join(part.rows + [part.line()])
    names = {row.split()[0] for row in part.rows}
    assert {"layernorm_forward", "bias_gelu_backward", "softmax_backward", "cross_entropy",
            "adamw", "flash_attention"} <= names, part.rows
    assert "flash_attention T=45 D=16" in "\n".join(part.rows)


def test_fusion_part_times_each_op_three_ways_beside_its_prediction(emulator_rig):
    """Every op's three versions run with the arguments the GPU run gives them, and the
    predicted speedup is the roofline's: for a memory-bound op, its byte ratio."""
    from minidist.hardware import op_costs as oc
    part = check.fusion(emulator_rig)
    names = [row[2:28].strip() for row in part.rows[1:]]
    assert names == ["layernorm forward", "layernorm backward", "bias + gelu forward",
                     "bias + gelu backward", "causal softmax", "causal softmax backward",
                     "cross-entropy + grad", "adamw (16 tensors)", "attention T=45 D=16"]
    fused, unfused = oc.layernorm(TINY["N"], TINY["C"], 4)
    ratio = sum(k.bytes for k in unfused) / fused[0].bytes
    assert part.rows[1].split()[-2:] == [f"{ratio:.1f}x", "1/10"], part.rows[1]
    assert part.rows[8].split()[-1] == f"1/{14 * 16}", part.rows[8]     # 14 passes a tensor
    assert part.line().startswith("MISMATCH: fusion: ")            # 1 ms each: no speedup


def test_gap():
    a = (np.array([1.0, 2.0]), {"w": np.array([0.5, 0.25])})
    b = (np.array([1.0, 2.5]), {"w": np.array([0.5, 0.0])})
    assert check.gap(a, b) == 0.5
    assert check.gap(a, (a[0], {"w": np.array([0.5, 1.25])})) == 1.0


def test_verdict_lines_exit_code_and_a_part_that_raises(monkeypatch, capsys):
    fake = types.SimpleNamespace(__version__="0.0-test")
    monkeypatch.setattr(check, "find_gpu", lambda: (fake, ""))
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


@pytest.mark.gpu
def test_the_whole_check_on_a_gpu():
    if check.find_gpu()[0] is None:
        pytest.skip("needs CuPy and a CUDA device")
    assert check.main([]) == 0
