"""Fixtures of the GPU tests: a kernel cache for the session, the emulator built once.

Every test here that builds kernels shares one cache folder (build.py keys each library by
a hash of its source and flags), so a kernel file is compiled once per session and
variant, not once per test; sanitized child processes inherit the folder through
MINIDIST_KERNEL_CACHE and find the libraries the parent built. A cache the user set is
used as is; the session's own is removed at the end.
"""

from __future__ import annotations

import os
import shutil

import pytest

from minidist.gpu.emulate.build import build_many, compiler_missing, sanitizer_missing

# The fused kernels and their unfused sequences (the SGEMM ladder has its own tests).
KERNEL_FILES = ("layernorm.cu", "bias_gelu.cu", "softmax.cu", "cross_entropy.cu", "adamw.cu",
                "flash_attention.cu", "unfused.cu")


@pytest.fixture(autouse=True, scope="session")
def kernel_cache(tmp_path_factory):
    """MINIDIST_KERNEL_CACHE for the session: the user's, or a temporary folder."""
    if "MINIDIST_KERNEL_CACHE" in os.environ:
        yield os.environ["MINIDIST_KERNEL_CACHE"]
        return
    path = tmp_path_factory.mktemp("kernel-cache")
    os.environ["MINIDIST_KERNEL_CACHE"] = str(path)
    yield str(path)
    del os.environ["MINIDIST_KERNEL_CACHE"]
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def emulator():
    """An Emulator with KERNEL_FILES built (in parallel, once); skips without g++."""
    reason = compiler_missing()
    if reason:
        pytest.skip(reason)
    from minidist.gpu.emulate.runner import Emulator
    build_many(KERNEL_FILES)
    return Emulator()


@pytest.fixture(scope="session")
def sanitized():
    """prepare(variant): build KERNEL_FILES for the sanitizer, or skip saying why not."""
    built = set()

    def prepare(variant: str) -> None:
        reason = sanitizer_missing(variant)
        if reason:
            pytest.skip(reason)
        if variant not in built:
            build_many(KERNEL_FILES, variant)
            built.add(variant)
    return prepare
