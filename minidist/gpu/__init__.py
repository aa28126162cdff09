"""The GPU path: CUDA kernels for the hot ops, verified on the CPU, launched by CuPy on a GPU.

The fused kernels (`gpu/kernels/*.cu`: LayerNorm forward and backward, bias+GeLU, scaled
causal softmax, cross-entropy with the gradient in place, multi-tensor AdamW, online-softmax
attention forward) each have an unfused twin (`unfused.cu`) and a NumPy float64 twin, and
seven SGEMM rungs (`sgemm_1_naive.cu` .. `sgemm_7_warptile.cu`) walk the memory hierarchy
(coalescing, shared-memory tiles, 1-D and 2-D register tiles, float4 loads, warp tiles),
beside a pointer chase and a bandwidth sweep. None of this needs a GPU to be checked:

  - Emulator (`gpu/emulate/`): the same `.cu` source compiled with g++ and a C++20 shim
    header (a block's threads as POSIX threads meeting at a barrier, `__shared__` as static
    storage, shuffles through an exchange slot) and run through ctypes; every kernel within
    6e-7 of its twin at 3 shapes x 2 block sizes, including sizes that are not multiples of
    the block. ThreadSanitizer and AddressSanitizer builds report nothing on the kernels and
    do catch a removed `__syncthreads` and a removed bounds guard (the tests plant both).
  - Compile gate (`python -m minidist.gpu.compile_gate [--update]`): nvcc for sm_90 with
    `--ptxas-options=-v` over every kernel, against the checked-in `resources.json`
    (registers, shared memory, spills); a spill or a kernel that stops compiling fails the
    tests. Tests that need an absent compiler skip with the reason.
  - Roofline (`python -m minidist roofline [--model tiny|gpt3-...] [--png F]`,
    `hardware/roofline.py`, `op_costs.py`): FLOPs and compulsory bytes of every op of a
    training step, fused and unfused, on the H200's roofs (FP32 66.9, FP64 33.5, TF32 494.7,
    BF16 989.4 TFLOP/s; HBM 4.8 TB/s) and on this CPU's, measured (matmul peak, copy
    bandwidth: ~94 GFLOP/s and ~31 GB/s one-thread float32 here); a test checks that no
    NumPy op beats its bound. The tiny GPT on an H200 is memory-bound in every op; fusion
    cuts its bytes 4.0x and its launches from 679 to 66. `python -m
    minidist.hardware.cpu_caches` shows this CPU's cache plateaus.
  - On a GPU (`pip install -e '.[gpu]'`: CuPy for CUDA 13 with its CUDA libraries):
    `--device gpu` (or `MINIDIST_DEVICE=gpu`) runs the single-process training on CuPy
    arrays (multi-rank GPU runs are refused in one line for now); `python -m minidist gpu
    check` runs, in a few minutes, every kernel against its twin, fused vs unfused timings
    beside the predicted byte ratio, the bandwidth kernels against 4.8 TB/s, the SGEMM
    ladder against `cupy.matmul` and the FP32 peak, the hierarchy sweep and a few GPT steps
    against the CPU, one OK/MISMATCH line per part (it imports nothing of the runtime, so it
    runs where `multiprocess` is missing). Kernels are timed K calls at a time between one
    CUDA event pair, queued behind a spin kernel that outlasts the host's enqueueing
    (`gpu/timing.py`), so no host time is inside a figure; each part synchronises at its
    end, and a sticky CUDA error stops the run naming the part. Exit codes: 0 all OK, 1 a
    mismatch or a missed target, 3 no GPU, 4 CuPy without its CUDA libraries.
  - Stand-in device (`gpu/standin.py`; `python -m minidist gpu check --dry-run`): the whole
    check runs on the CPU with NumPy arrays behind the CuPy calls and the emulator behind
    every RawKernel launch, which is checked as a GPU would (grid and block limits, shared
    memory, argument count and dtypes, contiguity, 16-byte alignment for float4, live
    pointers), with host waits inside a timed region flagged; the tests run every part this
    way and plant each defect the check must catch.
  - First contact (an H200, CuPy 14.2, CUDA 13.2): all 433 kernel comparisons within
    tolerance (worst 5.7e-7), training equal to the CPU (float64 8.6e-14), read 4.49 TB/s
    and copy 3.94 TB/s (82 %), SGEMM rungs 0.5, 6.3, 8.8, 11.3, 21.7, 26.8, 25.7 TFLOP/s
    against cuBLAS FP32's 51.3. That run also showed the defects fixed since (host time
    inside the timings, the pointer chase reading L2 where it said HBM, rung 7 below rung 6,
    LayerNorm backward's occupancy); the fixed kernels have not yet run on a GPU.

Importing this package needs neither CuPy nor a compiler; each module says what it needs.
Reading order:
    kernels/*.cu      the kernels, one concept per file, each headed by one block's view,
                      its shapes and its compulsory memory traffic
    twins.py          each kernel's NumPy float64 twin (autograd/fused.py, optim/adamw.py)
    fused.py          the fused ops as the launches they make, for any Device; CupyDevice
    unfused.py        the same computations, one simple kernel per step: what fusion saves
    emulate/          the same .cu source on CPU threads (runner.py is the front door),
                      with ThreadSanitizer and AddressSanitizer builds, and the checks
                      of every kernel against its twin (cases.py)
    hierarchy.py      the SGEMM ladder and the memory-hierarchy sweeps
    timing.py         K calls between one CUDA event pair, queued behind a hold kernel
    compile_gate.py   every kernel compiled for sm_90: registers, shared memory, spills
    standin.py        a stand-in GPU for the CPU tests: NumPy for CuPy, every launch checked
    check.py          `python -m minidist gpu check`: all of it on a real GPU (--dry-run:
                      on the stand-in)
"""
