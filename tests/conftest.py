"""Shared test settings: compiled programs are dropped after each test module, so a pytest worker's
memory (XLA's CPU executables, traced jaxprs) does not grow over the whole suite."""

import gc

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    yield
    jax.clear_caches()
    gc.collect()
