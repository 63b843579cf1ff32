#!/usr/bin/env bash
# Issue 16's kernel target rows on a lent sm90 GPU (the device tool's `run`), one part per call (each fits the
# 600 s limit): `tools/issue16_targets.sh mosaic` (dense / random 10% / 3% against cuDNN at 32k-512k,
# `bench_mosaic_gpu.py`), `patterns` / `patterns1m` (each `bench patterns` layout through `attend` against cuDNN at
# 128k with its parts, and Grid at the input's frame stride, 7 samples of queued calls / at 1M, `pattern_parts_profile.py`) or
# `tools/issue16_targets.sh minference` (MInference's kernels at 32k-512k against the Mosaic
# kernel with its default options on the identical top-100 mask, and on the Vertical-Slash form that meets the issue's
# 1.1x pair bound, `VerticalSlash(block_q=64, block_k=32, windows=True, window_align=8, window_tail=12,
# window_tail_cap=4096)`, not the pattern's default; needs a MInference checkout at ./mi_ckpt, untracked, carried
# with the tree); `momo` (the candidate-mass GPU tests, then MOMO at 1M against cuDNN, `Momo()` and with the
# re-rank's scores in fp8), `candidate-mass` (that kernel with bf16 / fp8 scores at 128k) and `momo-mass` (MOMO's
# captured mass at 1M, 16 query blocks per input, as `momo-mass-1m-16blocks-default_*`, re-rank in fp8 and bf16),
# `rerank-keep` / `rerank-orders` / `rerank-adaptive` (cheaper re-ranks' captured mass from one scoring per input: fewer candidates, some
# kept unscored, and the kernel's ms per scored count / other union orders / a share of the lists re-ranked,
# `momo_rerank_variants.py`) and
# `heads-first` (the block-sparse Mosaic kernel's GPU tests of its item orders, then its time with query heads fastest
# against query blocks fastest on MOMO's layout and the kernel rows, `heads_first_bench.py`); `momo-share` (the
# candidate-mass GPU tests, MOMO at 1M and its 16-block mass with the default `rerank_share`); `item-order` (the
# persistent-grid GPU tests, the persistent grid's item order by counting against XLA's sort at 32k,
# `short_work_trace.py --orders-only`, and MInference's top-100 mask at 32k); `short-rows` (the item orders again,
# then the kernel rows at 32k and 128k without the checks); `order-traces` (the item orders with each form's device
# time from a profiler trace); `boundary` (the pattern GPU tests, then Grid(frame) inside QBoundary and TwoDBoundary at
# 128k over 1,000 text tokens, the video and a 64-token question, `pattern_parts_profile.py --boundary q|2d`);
# `boundary-2d` (TwoDBoundary alone, no tests: a quick A / B with overlay_ab.sh); `grid` (the Mosaic GPU tests of
# strided rows and shared columns, then Grid and Grid(frame) alone at 128k, 7 samples); `grid1m` (Grid and
# Grid(frame) alone at 1M, then Grid(frame) inside TwoDBoundary at 1M over 1,000 text tokens, the video and a 64-token
# question, each with XLA's plan of the call's temporaries); `grid-search` (the Mosaic GPU tests of per-head key
# orders, then Grid with searched strides alone at 128k, 7 samples, and at 1M, 3 single calls: an overlay A / B);
# `frame-first` (the GPU tests of Grid with searched strides and the frame size known, then Grid and Grid(frame) at
# 128k, each layout's attend and each pattern's own attend, Grid's with `frame_first` on and off, 7 samples) and
# `frame-first1m` (Grid's at 1M, single calls); `build` (Grid's estimation and layout build step by step at 128k and
# 1M, `layout_build_profile.py`, last_q_scores with a group's heads together and through a gather beside the default,
# the per-head orders by stable argsort beside `grid.phase_order`'s, and a profiler trace of the steps by kernel);
# `scores` (the fused last-rows scoring kernel's GPU tests and the pattern GPU tests, then the kernel against its XLA
# reference at 128k and 1M, `last_q_scores_bench.py`, then `build` at both lengths);
# `phase-mass` (the phase-mass kernel's GPU tests, then Grid's stride search at 128k and 1M, vertical top phases and
# slash multiples: the per-stride XLA loop, the kernel for the vertical side only, and one call over both stacked
# through the reference and the kernel, `phase_mass_bench.py`);
# `prior` (the Mosaic GPU tests of a prior result and a row mask merged in and the pattern GPU tests, then Grid and
# Grid(frame) at 128k, 7 samples, attend as it is and with KernelOptions(merge_in_launch=True), the latter with the
# layout's parts in its order and reversed (the band, not the lines, taking the prior), each with a profiler trace
# by kernel) and `prior-boundary` (Grid(frame) inside QBoundary and TwoDBoundary over 1,000 text tokens, the video
# and a 64-token question, the three ways, 5 samples);
# `prior-copies` (Grid(frame) at 128k with and without merge_in_launch, once, each form's HLO copies with the lines
# that define and use them);
# `item-regions` (Mosaic GPU's profiler over random 3% at 32k, 128- and 64-key blocks, 4 query heads of one key /
# value head, with the kernel's `item` / `plan` / `finish` regions: where the cycles outside the named regions went);
# `kv-major` (the Mosaic GPU tests of per-head key orders and of the persistent grid, then the persistent grid's item
# orders at 32k with `short_work_trace.py --orders-only`, the key / value heads slowest among them);
# `compile-real` (attend's compile time at 128k with the real Mosaic kernels, Grid and Grid(frame), the layout
# closed over and as a jit argument, `attend_compile_time.py --kernels real`).
# Results and logs go to $OUT/<part>/; the exit status is the benchmark's.
set -u -o pipefail
part=${1:?mosaic or minference}
source "$(dirname "$0")/carried_wheels.sh" || exit 1
export PYTHONPATH=${PYTHONPATH}:${PWD}/tools
mkdir -p "$OUT/$part"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/$part/gpu.txt"

boundary_profile() {  # WRAP OUT: Grid(frame) inside the wrapper at 128k, 1,000 text tokens, the video, 64 more
  timeout 150 python3 tools/pattern_parts_profile.py --out "$2" --seq-len 131072 --skip-triton --split 0 --skip-parts \
    --no-trace --reps 5 --batch-s 0.15 --patterns "Grid(frame)" --boundary "$1" --text 1000 --question 64
}
case $part in
  mosaic) timeout 560 python3 tools/bench_mosaic_gpu.py --out "$OUT/$part" ;;
  patterns) timeout 560 python3 tools/pattern_parts_profile.py --out "$OUT/$part" --seq-len 131072 --skip-triton \
      --no-trace --split 0 --reps 7 --batch-s 0.15 --patterns AShape TriShape SFFixed Grid "Grid(frame)" ;;
  patterns1m) timeout 560 python3 tools/pattern_parts_profile.py --out "$OUT/$part" --seq-len 1048576 --skip-triton \
      --skip-parts --no-trace --split 0 ;;
  minference) timeout 560 python3 tools/minference_side_by_side.py --minference mi_ckpt --out "$OUT/$part" \
      --select "mosaic_gpu: same 64x64 mask;mosaic_gpu: 64 rows, 32-key windows from multiples of 8, tails <= 12 as columns (at most 4096 a head)" ;;
  momo) python3 -m pytest -q -p no:cacheprovider -m gpu tests/pallas_kernels/candidate_mass/test_candidate_mass_gpu.py \
      && timeout 200 python3 -m mmjax.drivers.cli bench momo --seq-lens 1048576 --implementation mosaic_gpu \
      --tile 64 4 --fig4-ks --mass-lens --out "$OUT/$part" --name momo-1m-timing \
      && timeout 200 python3 -m mmjax.drivers.cli bench momo --seq-lens 1048576 --implementation mosaic_gpu \
      --tile 64 4 --fig4-ks --mass-lens --rerank-fp8 --out "$OUT/$part" --name momo-1m-timing-rerank-fp8 ;;
  candidate-mass) timeout 300 python3 tools/candidate_mass_tune.py --out "$OUT/$part/candidate-mass.jsonl" \
      --label targets --seq-len 131072 --candidates 512 --strides 2 1 --skip-triton-sweep --mosaic-stages 2 \
      --mosaic-per-steps 2 --fp8s 0 1 ;;
  momo-mass) for prec in fp8 bf16; do
      flag=(); [ "$prec" = fp8 ] && flag=(--rerank-fp8)
      timeout 250 python3 -m mmjax.drivers.cli bench momo --mass-only --mass-rows 2048 --mass-lens 1048576 \
        --implementation mosaic_gpu --algorithms estimated --scans golden_pairs --quantiles histogram "${flag[@]}" \
        --out "$OUT/$part" --name "momo-mass-1m-16blocks-rerank-$prec" || exit 1
    done ;;
  rerank-keep) timeout 560 python3 tools/momo_rerank_variants.py --out "$OUT/$part/momo-rerank-keep.jsonl" --fp8 --time \
      --orders mass --keeps 0 16 32 64 96 ;;
  rerank-orders) timeout 560 python3 tools/momo_rerank_variants.py --out "$OUT/$part/momo-rerank-orders.jsonl" ;;
  rerank-adaptive) timeout 560 python3 tools/momo_rerank_variants.py --out "$OUT/$part/momo-rerank-adaptive.jsonl" \
      --strides 2 --orders mass --adaptive ;;
  momo-share) python3 -m pytest -q -p no:cacheprovider -m gpu tests/pallas_kernels/candidate_mass/test_candidate_mass_gpu.py \
      -k matches_reference 2>&1 | tail -3; \
      timeout 110 python3 -m mmjax.drivers.cli bench momo --seq-lens 1048576 --implementation mosaic_gpu \
      --tile 64 4 --fig4-ks --mass-lens --out "$OUT/$part" --name momo-1m-timing-share; \
      timeout 250 python3 -m mmjax.drivers.cli bench momo --mass-only --mass-rows 2048 --mass-lens 1048576 \
        --implementation mosaic_gpu --algorithms estimated --scans golden_pairs --quantiles histogram \
        --out "$OUT/$part" --name momo-mass-1m-16blocks-share ;;
  item-order) python3 -m pytest -q -p no:cacheprovider -m gpu tests/pallas_kernels/block_sparse/test_mosaic_gpu_gpu.py \
      -k "persistent" 2>&1 | tail -3; \
      timeout 300 python3 tools/short_work_trace.py --out "$OUT/$part" --orders-only; \
      timeout 200 python3 tools/minference_side_by_side.py --minference mi_ckpt --out "$OUT/$part" --lens 32768 \
        --indexes block --select "mosaic_gpu: same 64x64 mask" ;;
  short-rows) timeout 200 python3 tools/short_work_trace.py --out "$OUT/$part" --orders-only; \
      timeout 360 python3 tools/bench_mosaic_gpu.py --out "$OUT/$part" --lens 32768,131072 --skip-checks ;;
  prior-copies) timeout 240 python3 tools/pattern_parts_profile.py --out "$OUT/$part" --seq-len 131072 --skip-triton \
      --split 0 --skip-parts --no-trace --reps 1 --merge-in-launch --hlo-copy-context --patterns "Grid(frame)" ;;
  item-regions) for bk in 128 64; do
        timeout 200 python3 tools/mosaic_profile.py --out "$OUT/$part/bk$bk" --random 0.03 --block-k $bk --heads 4
      done ;;
  kv-major) XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 \
      tests/pallas_kernels/block_sparse/test_mosaic_gpu_gpu.py -k "per_head_key_orders or persistent" 2>&1 | tail -3; \
      timeout 330 python3 tools/short_work_trace.py --out "$OUT/$part" --orders-only ;;
  order-traces) timeout 300 python3 tools/short_work_trace.py --out "$OUT/$part" --orders-only --order-traces ;;
  boundary) XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 \
      tests/sparse/test_patterns_gpu.py 2>&1 | tail -3; \
      for b in q 2d; do boundary_profile $b "$OUT/$part/$b"; done ;;
  grid) XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 \
      tests/pallas_kernels/block_sparse/test_mosaic_gpu_gpu.py -k "strided_rows or shared_columns" 2>&1 | tail -3; \
      timeout 300 python3 tools/pattern_parts_profile.py --out "$OUT/$part" --seq-len 131072 --skip-triton \
      --split 0 --skip-parts --no-trace --reps 7 --batch-s 0.15 --patterns Grid "Grid(frame)" ;;
  boundary-2d) boundary_profile 2d "$OUT/$part" ;;
  grid-search) XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -p no:cacheprovider -m gpu -n 2 \
      tests/pallas_kernels/block_sparse/test_mosaic_gpu_gpu.py -k "per_head_key_orders" 2>&1 | tail -3; \
      timeout 90 python3 tools/pattern_parts_profile.py --out "$OUT/$part/128k" --seq-len 131072 --skip-triton \
      --split 0 --skip-parts --no-trace --reps 7 --batch-s 0.15 --patterns Grid; \
      timeout 170 python3 tools/pattern_parts_profile.py --out "$OUT/$part/1m" --seq-len 1048576 --skip-triton \
      --skip-parts --no-trace --split 0 --patterns Grid ;;
  grid1m) timeout 270 python3 tools/pattern_parts_profile.py --out "$OUT/$part/alone" --seq-len 1048576 --skip-triton \
      --skip-parts --no-trace --split 0 --patterns Grid "Grid(frame)"; \
      timeout 270 python3 tools/pattern_parts_profile.py --out "$OUT/$part/2d" --seq-len 1048576 --skip-triton \
      --skip-parts --no-trace --split 0 --patterns "Grid(frame)" --boundary 2d --text 1000 --question 64 ;;
  frame-first) XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/sparse/test_patterns_gpu.py -k "frame_known" 2>&1 | tail -3; \
      timeout 330 python3 tools/pattern_parts_profile.py --out "$OUT/$part" --seq-len 131072 --skip-triton \
      --split 0 --skip-parts --no-trace --reps 7 --batch-s 0.15 --pattern-attend --patterns Grid "Grid(frame)" ;;
  frame-first1m) timeout 540 python3 tools/pattern_parts_profile.py --out "$OUT/$part" --seq-len 1048576 \
      --skip-triton --skip-parts --no-trace --split 0 --pattern-attend --patterns Grid ;;
  build) for len in 131072 1048576; do
      timeout 240 python3 tools/layout_build_profile.py --out "$OUT/$part/$len" --seq-len $len --reps 3 --trace || exit 1
    done ;;
  scores) XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 \
      tests/pallas_kernels/last_q_scores tests/sparse/test_patterns_gpu.py 2>&1 | tail -4; \
      timeout 180 python3 tools/last_q_scores_bench.py --out "$OUT/$part" --lens 131072 1048576; \
      for len in 131072 1048576; do
        timeout 130 python3 tools/layout_build_profile.py --out "$OUT/$part/$len" --seq-len $len --reps 3 --trace
      done ;;
  phase-mass) XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/pallas_kernels/phase_mass 2>&1 | tail -3; \
      timeout 200 python3 tools/phase_mass_bench.py --out "$OUT/$part" --lens 131072 1048576 ;;
  prior) XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 \
      tests/pallas_kernels/block_sparse/test_mosaic_gpu_gpu.py tests/sparse/test_patterns_gpu.py \
      -k "prior or test_patterns_gpu" 2>&1 | tail -3; \
      timeout 300 python3 tools/pattern_parts_profile.py --out "$OUT/$part" --seq-len 131072 --skip-triton \
      --split 0 --skip-parts --reps 7 --batch-s 0.15 --merge-in-launch --patterns Grid "Grid(frame)" ;;
  prior-boundary) for b in q 2d; do
        timeout 270 python3 tools/pattern_parts_profile.py --out "$OUT/$part/$b" --seq-len 131072 --skip-triton \
          --split 0 --skip-parts --no-trace --reps 5 --batch-s 0.15 --merge-in-launch --patterns "Grid(frame)" \
          --boundary $b --text 1000 --question 64
      done ;;
  compile-real) timeout 300 python3 tools/attend_compile_time.py --kernels real --seq-len 131072 \
      --patterns Grid "Grid(frame)" ;;
  heads-first) python3 -m pytest -q -p no:cacheprovider -m gpu tests/pallas_kernels/block_sparse/test_mosaic_gpu_gpu.py \
      -k "heads_first or persistent_grid" 2>&1 | tail -5; \
      timeout 400 python3 tools/heads_first_bench.py --out "$OUT/$part/heads-first.jsonl" --cudnn ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac 2>&1 | tee "$OUT/$part/log.txt"
