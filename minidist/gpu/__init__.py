"""The GPU path: CUDA kernels for the hot ops, verified on the CPU, launched by CuPy on a GPU.

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
