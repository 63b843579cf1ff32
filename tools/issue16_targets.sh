#!/usr/bin/env bash
# Issue 16's kernel target rows on a lent sm90 GPU (the device tool's `run`), one part per call (each fits the
# 600 s limit): `tools/issue16_targets.sh mosaic` (dense / random 10% / 3% against cuDNN at 32k-512k,
# `bench_mosaic_gpu.py`) or `tools/issue16_targets.sh minference` (MInference's top-100 mask and Vertical-Slash index
# against our default Mosaic forms at 32k-512k; needs a MInference checkout at ./mi_ckpt, untracked, carried with
# the tree). Results and logs go to $OUT/<part>/.
set -u
part=${1:?mosaic or minference}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:${PWD}:${PWD}/tools
mkdir -p "$OUT/$part"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/$part/gpu.txt"
case $part in
  mosaic) timeout 560 python3 tools/bench_mosaic_gpu.py --out "$OUT/$part" ;;
  minference) timeout 560 python3 tools/minference_side_by_side.py --minference mi_ckpt --out "$OUT/$part" \
      --select "mosaic_gpu: same 64x64 mask;mosaic_gpu: 64 rows, 32-key windows from multiples of 8, tails <= 12 as columns (at most 4096 a head)" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac 2>&1 | tee "$OUT/$part/log.txt"
