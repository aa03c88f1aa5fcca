#!/usr/bin/env bash
# Build jax_fp4 for this machine's GPU, run the GPU tests, then the benchmarks: the default sweep,
# the decode step and its GEMVs (decode.py), mixture-of-experts (moe.py, routing.py, and decode.py
# on the MoE preset). The moe_block part (only when asked for) checks and times the
# mixture-of-experts block (jax_fp4.moe): its GPU tests, its kernels' tests once under
# compute-sanitizer memcheck, and moe.py's block part. The serving part (only when asked for)
# times the example's decode step at serving batches and profiles each matmul of its layer at
# those M under Nsight Compute (the GEMV and the fused GEMM's configurations, and each one's stall
# samples per SASS instruction at M = 32).
#
#   bash benchmarks/run_gpu_suite.sh [--skip-build]
#                                    [--only tests|bench|decode|moe|moe_block|serving] [OUTDIR]
#
# Run from the repository root, in the Python environment to test (jax with CUDA installed).
# OUTDIR (default ./gpu_suite_out) receives build.log and a .log (and .json) per part.
set -uo pipefail

build=1 only="" out=""
while (($#)); do
  case "$1" in
    --skip-build) build=0 ;;
    --only) only="${2:?--only takes tests, bench, decode, moe, moe_block or serving}"; shift ;;
    -h|--help) sed -n 2,15p "$0"; exit 0 ;;
    *) out="$1" ;;
  esac
  shift
done
case "$only" in ""|tests|bench|decode|moe|moe_block|serving) ;; *) echo "--only takes tests, bench, decode, moe, moe_block or serving, got '$only'" >&2; exit 2 ;; esac
out="${out:-./gpu_suite_out}"
mkdir -p "$out"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
status=0

if ((build)); then
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
  [[ -n "$cap" ]] || { echo "nvidia-smi reports no GPU" >&2; exit 1; }
  arch="${cap}-real"
  [[ "$cap" == 90 || "$cap" == 120 ]] && arch="${cap}a-real"  # wgmma / SM120 GEMM need the "a" target
  echo "== build for sm_$cap ($arch)"
  JAX_FP4_CUDA=ON CMAKE_ARGS="-DJAX_FP4_CUDA_ARCHITECTURES=$arch" \
    python -m pip install --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1 \
    || { echo "build failed: $out/build.log" >&2; tail -20 "$out/build.log" >&2; exit 1; }
  python -m jax_fp4 info 2>&1 | tee -a "$out/build.log"
fi

if [[ -z "$only" || "$only" == tests ]]; then
  echo "== GPU tests"
  workers=()
  python -c "import xdist" 2>/dev/null && workers=(-n 4)
  python -m pytest -q -m gpu "${workers[@]}" tests 2>&1 | tee "$out/tests.log"
  ((PIPESTATUS[0] == 0)) || status=1
fi

if [[ -z "$only" || "$only" == bench ]]; then
  echo "== benchmark (default sweep and decode step)"
  python benchmarks/bench.py --layout tiled --decode-step --json "$out/bench.json" 2>&1 | tee "$out/bench.log"
  ((PIPESTATUS[0] == 0)) || status=1
fi

if [[ -z "$only" || "$only" == decode ]]; then
  echo "== decode step and its GEMVs"
  python benchmarks/decode.py --json "$out/decode.json" 2>&1 | tee "$out/decode.log"
  ((PIPESTATUS[0] == 0)) || status=1
fi

if [[ -z "$only" || "$only" == moe ]]; then
  echo "== mixture-of-experts"
  python benchmarks/moe.py --json "$out/moe.json" 2>&1 | tee "$out/moe.log"
  ((PIPESTATUS[0] == 0)) || status=1
  python benchmarks/routing.py --json "$out/routing.json" 2>&1 | tee "$out/routing.log"
  ((PIPESTATUS[0] == 0)) || status=1
  # The MoE model's decode step against its bf16 twin: all 48 layers of both need an H200's
  # memory; a smaller GPU (an H100's 80 GB) runs 24.
  memory_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  layers=()
  ((${memory_mib:-0} >= 120000)) || layers=(--layers 24)
  python benchmarks/decode.py --model qwen3-30b-a3b "${layers[@]}" --batches 1,8 --no-gemv \
    --no-prefill --no-long-prompt --json "$out/moe_step.json" 2>&1 | tee "$out/moe_step.log"
  ((PIPESTATUS[0] == 0)) || status=1
fi

if [[ "$only" == moe_block ]]; then
  echo "== the mixture-of-experts block"
  python -m pytest -q -m gpu tests/test_moe_block.py tests/test_moe_kernels.py 2>&1 \
    | tee "$out/moe_block_tests.log"
  ((PIPESTATUS[0] == 0)) || status=1
  compute-sanitizer --tool memcheck --error-exitcode 9 \
    python -m pytest -q -x -m gpu tests/test_moe_kernels.py 2>&1 | tail -20 \
    | tee "$out/moe_block_memcheck.log"
  ((PIPESTATUS[0] == 0)) || status=1
  python benchmarks/moe.py --parts block --json "$out/moe_block.json" 2>&1 \
    | tee "$out/moe_block.log"
  ((PIPESTATUS[0] == 0)) || status=1
fi

if [[ "$only" == serving ]]; then
  echo "== serving batches: the decode step, then each matmul of its layer under Nsight Compute"
  python benchmarks/decode.py --batches 16,32,64 --no-gemv --no-prefill --no-long-prompt \
    --json "$out/serving_decode.json" 2>&1 | tee "$out/serving_decode.log"
  ((PIPESTATUS[0] == 0)) || status=1
  if command -v ncu >/dev/null; then
    # The layer's four matmuls (Llama-3-8B: q/k/v, o, gate/up, down) at each M; the GEMV as the
    # dispatch runs it, the fused GEMM also with its multistage kernel and a fixed split of 4.
    serving_cases() {
      local cases=() m shape
      for m in 16 32 64; do
        for shape in 6144x4096 4096x4096 28672x4096 4096x14336; do cases+=("$1:$m:$shape"); done
      done
      (IFS=,; echo "${cases[*]}")
    }
    for backend in gemv fused; do
      tunings=(--tuning "")
      [[ $backend == fused ]] && tunings+=(--tuning fused_warp_specialized=0 --tuning fused_split=4)
      ncu --clock-control none -k regex:"Gemv|Fused" --section SpeedOfLight --section LaunchStats \
        --section Occupancy --section WarpStateStats --section SchedulerStats \
        python benchmarks/profile_kernels.py --layout tiled --cases "$(serving_cases $backend)" \
        "${tunings[@]}" >"$out/serving_ncu_$backend.log" 2>&1
      (($? == 0)) || status=1
    done
    # Where the warps stall at M = 32 (the sections above give rates, not reasons): the third call
    # of each kernel with its per-instruction stall samples, summarised by ncu_sass_summary.py.
    for c in fused:32:4096x4096 fused:32:28672x4096 gemv:32:4096x4096; do
      rep="$out/serving_stalls_${c//:/_}"
      ncu --clock-control none -k regex:"Gemv|Fused" -s 2 -c 1 --section SourceCounters \
        --section WarpStateStats -f -o "$rep" \
        python benchmarks/profile_kernels.py --layout tiled --cases "$c" >"$rep.log" 2>&1 &&
        ncu -i "$rep.ncu-rep" --page source --print-source sass --csv >"$rep.csv" &&
        python benchmarks/ncu_sass_summary.py "$rep.csv" >"$rep.txt"
      (($? == 0)) || status=1
    done
  else
    echo "ncu not found: the serving part's kernel profiles are skipped" | tee -a "$out/serving_decode.log"
  fi
fi

echo "== logs in $out"
exit $status
