"""Shared test settings.

* XLA compiles the suite's CPU programs without LLVM's optimisation passes: the suite compiles far more than it
  runs (tiny shapes), and those passes take much of each compile. Measured on the 2-core CI-size machine,
  2026-11-27: ``tests/speculative`` 254 -> 236 s, one boundary parity case 67 -> 62 s. The flags go into
  ``XLA_FLAGS`` before JAX starts its CPU backend (flags already there are kept; subprocesses inherit them).
* Compiled programs are dropped after each test module, so a pytest worker's memory (XLA's CPU executables,
  traced jaxprs) does not grow over the whole suite.
"""

import gc
import os

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    yield
    jax.clear_caches()
    gc.collect()
