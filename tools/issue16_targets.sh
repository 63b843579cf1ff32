#!/usr/bin/env bash
# Issue 16's kernel target rows on a lent sm90 GPU (the device tool's `run`), one part per call (each fits the
# 600 s limit): `tools/issue16_targets.sh mosaic` (dense / random 10% / 3% against cuDNN at 32k-512k,
# `bench_mosaic_gpu.py`), `patterns` / `patterns1m` (each `bench patterns` layout through `attend` against cuDNN at
# 128k with its parts, and Grid at the input's frame stride, 7 samples of queued calls / at 1M, `pattern_parts_profile.py`) or
# `tools/issue16_targets.sh minference` (MInference's kernels at 32k-512k against the Mosaic
# kernel with its default options on the identical top-100 mask, and on the Vertical-Slash form that meets the issue's
# 1.1x pair bound, `VerticalSlash(block_q=64, block_k=32, windows=True, window_align=8, window_tail=12,
# window_tail_cap=4096)`, not the pattern's default; needs a MInference checkout at ./mi_ckpt, untracked, carried
# with the tree). Results and logs go to $OUT/<part>/; the exit status is the benchmark's.
set -u -o pipefail
part=${1:?mosaic or minference}
source "$(dirname "$0")/carried_wheels.sh" || exit 1
export PYTHONPATH=${PYTHONPATH}:${PWD}/tools
mkdir -p "$OUT/$part"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/$part/gpu.txt"
case $part in
  mosaic) timeout 560 python3 tools/bench_mosaic_gpu.py --out "$OUT/$part" ;;
  patterns) timeout 560 python3 tools/pattern_parts_profile.py --out "$OUT/$part" --seq-len 131072 --skip-triton \
      --no-trace --split 0 --reps 7 --batch-s 0.15 --patterns AShape TriShape SFFixed Grid "Grid(frame)" ;;
  patterns1m) timeout 560 python3 tools/pattern_parts_profile.py --out "$OUT/$part" --seq-len 1048576 --skip-triton \
      --skip-parts --no-trace --split 0 ;;
  minference) timeout 560 python3 tools/minference_side_by_side.py --minference mi_ckpt --out "$OUT/$part" \
      --select "mosaic_gpu: same 64x64 mask;mosaic_gpu: 64 rows, 32-key windows from multiples of 8, tails <= 12 as columns (at most 4096 a head)" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac 2>&1 | tee "$OUT/$part/log.txt"
