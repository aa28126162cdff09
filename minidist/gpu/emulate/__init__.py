"""The CPU emulator: the same .cu kernel source, compiled with a C++ shim, run on CPU threads.

cuda_shim.h (the CUDA built-ins as C++20), source.py (a kernel's parameters, read from the
.cu), build.py (g++ into a cached shared library; plain, ThreadSanitizer and
AddressSanitizer variants), runner.py (launch a kernel on NumPy arrays), sanitize.py (run
code in a process with a sanitizer runtime), cases.py (every kernel against its twin).
Read first: runner.py's docstring, the API.
"""
