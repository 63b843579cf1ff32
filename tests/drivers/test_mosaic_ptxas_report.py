"""tools/mosaic_ptxas_report.py's `inflight_writes`: PTX writes to registers of a wgmma pipeline stage (what
ptxas's C7513 note names), read on a CPU machine."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))
from mosaic_ptxas_report import inflight_writes  # noqa: E402

S = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r1, %r2}, %rd1, %rd2, p, 1, 1, 0, 1;"
PV = "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%r5, %r6}, {%r10, %r11}, %rd3, p, 1, 1, 1;"


def _ptx(*lines):
    return "\n".join(f"\t{ln}" for ln in lines)


def test_write_to_an_accumulator_in_flight_is_found():
    ptx = _ptx("mov.b32 %r1, 0;", "wgmma.fence.sync.aligned;", S, "wgmma.commit_group.sync.aligned;",
               "selp.f32 %r2, %r7, 0fFF800000, %p1;", "add.f32 %r8, %r7, %r7;",
               "wgmma.wait_group.sync.aligned 0;", "mov.b32 %r1, %r8;")
    hits = inflight_writes(ptx)
    assert [(h["line"], h["register"], h["wgmma_line"]) for h in hits] == [(5, "%r2", 3)]


def test_write_to_a_register_operand_of_a_later_wgmma_of_the_stage_is_found():
    """P's registers rewritten after S = Q K^T was issued and before P V: inside the stage."""
    ptx = _ptx(S, "wgmma.commit_group.sync.aligned;", "cvt.rn.bf16x2.f32 %r10, %r3, %r4;", PV,
               "wgmma.commit_group.sync.aligned;", "wgmma.wait_group.sync.aligned 1;",
               "mul.f32 %r20, %r1, %r1;", "wgmma.wait_group.sync.aligned 0;", "cvt.rn.bf16x2.f32 %r11, %r3, %r4;")
    hits = inflight_writes(ptx)
    assert [(h["line"], h["register"], h["wgmma_line"]) for h in hits] == [(3, "%r10", 4)]


def test_stage_stays_open_until_no_group_is_in_flight():
    ptx = _ptx(PV, "wgmma.commit_group.sync.aligned;", S, "wgmma.commit_group.sync.aligned;",
               "wgmma.wait_group.sync.aligned 1;", "mov.b32 %r5, %r9;", "wgmma.wait_group.sync.aligned 0;",
               "mov.b32 %r6, %r9;")
    assert [h["line"] for h in inflight_writes(ptx)] == [6]


def test_stores_predicates_and_code_outside_stages_are_not_writes():
    ptx = _ptx("mov.b32 %r1, 0;", S, "wgmma.commit_group.sync.aligned;", "st.shared.f32 [%rd5], %r1;",
               "setp.ne.b32 %p2, %r9, 0;", "wgmma.wait_group.sync.aligned 0;", "mov.b32 %r2, 1;")
    assert inflight_writes(ptx) == []
