"""`mmjax bench kernels` on CPU at toy sizes (interpret mode): the table's rows and checks, and its "layout ms"
column, a difference of two medians, shown only where it is above zero."""

from __future__ import annotations

import dataclasses

import pytest

from mmjax.drivers.bench import kernels

TOY = dataclasses.replace(kernels.CPU_CONFIG, seq_lens=(128,), sparse_only_lens=(), heads=2, kv_heads=1, head_dim=32,
                          check_len=128, tune_len=128, tiles=((32, 32, 4, 2),), keeps=(0.5,))


@pytest.fixture
def fixed_times(monkeypatch):
    """time_fn runs each function once and returns the next of the given medians (sweep, anchor, then per layout
    the call and the kernel alone)."""
    def install(medians):
        it = iter(medians)

        def fake(fn, **_):
            fn()
            return {"ms": next(it)}

        monkeypatch.setattr(kernels, "time_fn", fake)
    return install


def test_layout_time_is_shown_only_above_zero(fixed_times, tmp_path):
    fixed_times([1.0, 1.0, 2.0, 1.5, 1.0, 1.2])  # dense: call 2.0, kernel 1.5; random 50%: call 1.0, kernel 1.2
    lines = []
    result = kernels.run_benchmark(TOY, str(tmp_path), log=lines.append)
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"xla", "dense-layout", "random-50%"}
    assert rows["dense-layout"]["layout_ms"] == pytest.approx(0.5)
    assert rows["random-50%"]["layout_ms"] is None
    assert rows["random-50%"]["call_minus_kernel_ms"] == pytest.approx(-0.2)
    assert result["checks_passed"] and len(result["checks"]) == 2
    assert any(line.startswith("layout ms: the call's median time minus the kernel's alone") for line in lines)
    written = list(tmp_path.glob("kernels_*.json"))
    assert len(written) == 1 and '"call_minus_kernel_ms"' in written[0].read_text()
