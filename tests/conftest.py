"""Shared test settings.

* XLA compiles the suite's CPU programs without LLVM's optimisation passes: the suite compiles far more than it
  runs (tiny shapes), and those passes take much of each compile. Fresh-clone `make test` on the 2-core CI-size
  machine, 2026-11-27: pytest 29.7-33.8 -> 19.1-20.3 min, user CPU 62.2 -> 34.6-37.3 min. The flags go into
  ``XLA_FLAGS`` before JAX starts its CPU backend (flags already there are kept; subprocesses inherit them), on
  machines without an NVIDIA GPU only (the GPU backend's code generation is left as users get it). Unoptimised
  code may round differently in the last float32 bit (see the float8 tie in ``test_swiglu_quantize.py``).
* Compiled programs are dropped after each test module, so a pytest worker's memory (XLA's CPU executables,
  traced jaxprs) does not grow over the whole suite.
"""

import gc
import os
import shutil

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
CPU_ONLY = shutil.which("nvidia-smi") is None or os.environ.get("JAX_PLATFORMS") == "cpu"  # as the Makefile decides
if CPU_ONLY and FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    yield
    jax.clear_caches()
    gc.collect()
