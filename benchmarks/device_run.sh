#!/usr/bin/env bash
# One call on the lent H200 (the `device` tool): build, GPU tests, memcheck, benchmarks.
# Logs and JSON go under $OUT (at most 8 files come back). Pick the stages that fit the call:
#
#   bash benchmarks/device_run.sh first                # the next session's first call, ~8 min (build included; 10 files: tar them)
#   bash benchmarks/device_run.sh build tests          # the whole GPU suite, 4 processes (570 tests in 215 s, twenty-seventh session; the build ~80 s)
#   bash benchmarks/device_run.sh build suite          # the tests not marked gpu, on a GPU machine (~560 tests, CPU-bound)
#   bash benchmarks/device_run.sh build multi-gpu      # kind nvidia-h100-x2 or more: sharded across the GPUs
#   bash benchmarks/device_run.sh build sanitizer fused
#   SANITIZER_K="tiled" bash benchmarks/device_run.sh build sanitizer   # part of the memcheck sweep
#   bash benchmarks/device_run.sh build bench          # default sweep + decode step, ~6.5 min (+ targets.md)
#   bash benchmarks/device_run.sh build llm            # examples/llm_generate.py: 8B shapes, NVFP4 against bf16
#   LLM_AB_BASE=examples/ab_base_llm_generate.py bash benchmarks/device_run.sh build llm-ab   # ~4 min
#   DISPATCH_M=9,16,32 bash benchmarks/device_run.sh build dispatch-check   # auto against every backend
#   (four shapes at 11 M, prepacked: ~3 min; the spec layout at 12 M: ~5 min)
#   DISPATCH_BACKENDS=gemv,fused,dequant,xla DISPATCH_M=64,256,1024,4096 bash benchmarks/device_run.sh build xla-fusion dispatch-check
#   (whether XLA fuses the xla path's dequantize into its GEMM, then its times beside the kernels')
#   bash benchmarks/device_run.sh build pdl-ab        # programmatic dependent launch A/B, ~6 min
#   (bench and gemv-sweep time prepacked weights; BENCH_LAYOUT=spec for the spec layout;
#   every bench row is timed in two passes, BENCH_PASSES=1 for one: ~4 min)
#   bash benchmarks/device_run.sh build probe          # GEMV limiter probe, ~1 min
#   bash benchmarks/device_run.sh build kernel-tests probe gemv-sweep   # ~5 min
#   bash benchmarks/device_run.sh build gemv-configs   # every GEMV launch config at M = 1-16, ~1 min
#   SWEEP_M=17,32 PROBE_SHAPES="2048x16384" bash benchmarks/device_run.sh build gemv-configs   # M to 128
#   bash benchmarks/device_run.sh build probe gemv-profile   # ncu stall reasons per SASS line
#   bash benchmarks/device_run.sh build profile gemv-sweep fused-sweep   # ncu, launch-config sweeps
#   FUSED_SPLITS="auto 1 3" bash benchmarks/device_run.sh build fused-sweep  # fewer split factors
#   bash benchmarks/device_run.sh build fused-tests fused-tiles   # fused GEMM tests, CTA row tiles
#   bash benchmarks/device_run.sh build fused-crossovers   # the dispatch's crossovers, ~4 min
#   FUSED_TILE_N_SPLITS="auto 3 4" bash benchmarks/device_run.sh build fused-tests fused-tile-n   # 128-row weight tiles at M = 65-128
#   bash benchmarks/device_run.sh build fused-tests stream-k   # stream-K against cluster split-K, ~6 min
#   FUSED_LAYOUT=tiled STREAM_K_MS=80,128,256 bash benchmarks/device_run.sh build stream-k   # on prepacked weights
#   git show main:ffi/cuda/fused_gemm.cu > ab_base_fused_gemm.cu   # (here: the file travels untracked)
#   FUSED_AB_BASE=ab_base_fused_gemm.cu bash benchmarks/device_run.sh fused-ab fused-tests   # ~8 min
#
# Build for sm_90a only there (the full arch list compiles the sm_120a CUTLASS kernel for a minute).
set -uo pipefail
OUT=${OUT:-/tmp/jax_fp4_out}
export OUT
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0

build() {
  JAX_FP4_CUDA=ON CMAKE_ARGS="-DJAX_FP4_CUDA_ARCHITECTURES=90a-real" \
    python -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
}

for stage in "$@"; do
  case "$stage" in
    build)
      build
      python -m jax_fp4 info | tee -a "$OUT/build.log" ;;
    fused-ab)
      # Kernel-only A/B of two versions of ffi/cuda/fused_gemm.cu in one call: FUSED_AB_BASE (a
      # copy of the other version) and the working tree's, built and timed in the order
      # FUSED_AB_SIDES (default "base new base": in the eighteenth session identical code timed up
      # to 13% apart between two calls, so a base on both sides shows the drift within one);
      # the working tree's file is put back afterwards (also if a build fails).
      # FUSED_AB_MS / FUSED_AB_LAYOUT: fused_timing.py's. JSON per side: fused_ab_<i>_<side>.json.
      base=${FUSED_AB_BASE:?set FUSED_AB_BASE to a copy of the base version of ffi/cuda/fused_gemm.cu}
      cp ffi/cuda/fused_gemm.cu /tmp/ab_new_fused_gemm.cu
      trap 'cp /tmp/ab_new_fused_gemm.cu ffi/cuda/fused_gemm.cu' EXIT
      : > "$OUT/fused_ab.log"
      i=0
      for side in ${FUSED_AB_SIDES:-base new base}; do
        i=$((i + 1))
        case "$side" in
          base) cp "$base" ffi/cuda/fused_gemm.cu ;;
          new) cp /tmp/ab_new_fused_gemm.cu ffi/cuda/fused_gemm.cu ;;
          *) echo "FUSED_AB_SIDES: base or new, got $side" >&2; exit 2 ;;
        esac
        build
        echo "== $i $side" | tee -a "$OUT/fused_ab.log"
        timeout 120 python benchmarks/fused_timing.py --layout "${FUSED_AB_LAYOUT:-tiled}" --variants bf16,fused \
          --ms "${FUSED_AB_MS:-128,256,512,1024}" --json "$OUT/fused_ab_${i}_$side.json" 2>&1 \
          | grep -E "^ +[0-9]+ +[0-9]+ +[0-9]+ \|" | tee -a "$OUT/fused_ab.log" || status=1
      done
      python benchmarks/ab_compare.py "$OUT"/fused_ab_*_*.json | tee -a "$OUT/fused_ab.log" || status=1
      cp /tmp/ab_new_fused_gemm.cu ffi/cuda/fused_gemm.cu  # the working tree's version, built
      trap - EXIT
      [ "$side" = new ] || build ;;  # later stages run the working tree's build
    tests)
      # Serially the suite took 370 s (twenty-second session) and past 490 s (twenty-third), so it
      # runs in GPU_TEST_WORKERS pytest-xdist processes (default 4; xdist is in the device image)
      # sharing the GPU, none preallocating its memory; --durations names the slow tests. The
      # outer timeout: a hung kernel must not eat the whole device call.
      workers=${GPU_TEST_WORKERS:-4}
      python -c "import xdist" 2>/dev/null || workers=1
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${GPU_TEST_TIMEOUT:-540}" python -m pytest -q -m gpu tests \
        --durations=20 $([ "$workers" -gt 1 ] && echo "-n $workers") > "$OUT/gpu_tests.log" 2>&1 || status=1
      tail -25 "$OUT/gpu_tests.log" ;;
    suite)
      # The rest of README's test command on a GPU machine: the tests not marked gpu, which
      # tests/conftest.py keeps on the CPU device beside the GPU (never run there before the
      # thirty-third session). `build tests suite` is the whole suite.
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${SUITE_TIMEOUT:-400}" python -m pytest -q -m "not gpu" tests \
        $(python -c "import xdist" 2>/dev/null && echo "-n ${GPU_TEST_WORKERS:-8}") > "$OUT/suite.log" 2>&1 || status=1
      tail -15 "$OUT/suite.log" ;;
    multi-gpu)
      # On a machine of two or more GPUs (run's kind nvidia-h100-x2 and up): the kernels per shard
      # under jit + NamedSharding, shard_map and pmap (tests/test_gpu_sharding.py), then the
      # sharded-inference example across the GPUs. Keep NCCL's NVLink multicast off (the image's
      # NCCL_NVLS_ENABLE=0; KINDS.md).
      nvidia-smi -L > "$OUT/multi_gpu.log"
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 300 python -m pytest -q -m gpu tests/test_gpu_sharding.py \
        >> "$OUT/multi_gpu.log" 2>&1 || status=1
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python examples/sharded_inference.py \
        >> "$OUT/multi_gpu.log" 2>&1 || status=1
      tail -15 "$OUT/multi_gpu.log" ;;
    sanitizer)
      # memcheck instruments only jax_fp4's kernels (--kernel-name; XLA's own run at full speed).
      # Unfiltered it took ~2.7 s per test and never finished the quick sweep's 238 tests in one
      # call; SANITIZER_K (a pytest -k expression) splits the sweep over calls.
      XLA_PYTHON_CLIENT_ALLOCATOR=platform JAX_FP4_GPU_TEST_QUICK=1 timeout ${SANITIZER_TIMEOUT:-420} \
        compute-sanitizer --tool memcheck --error-exitcode 1 --kernel-name "${SANITIZER_KERNELS:-kns=jax_fp4}" \
        python -m pytest -q -m gpu tests/test_gpu_kernels.py tests/test_gpu_fused.py ${SANITIZER_K:+-k "$SANITIZER_K"} \
        > "$OUT/sanitizer.log" 2>&1 || status=1
      grep -E "ERROR SUMMARY|passed|failed|rror" "$OUT/sanitizer.log" | tail -5 ;;
    fused)
      python benchmarks/fused_timing.py --json "$OUT/fused_h200.json" > "$OUT/fused_timing.log" 2>&1 || status=1
      tail -25 "$OUT/fused_timing.log" ;;
    bench)
      python -m bench --layout "${BENCH_LAYOUT:-tiled}" --passes "${BENCH_PASSES:-2}" --decode-step --json "$OUT/h200.json" > "$OUT/bench.log" 2>&1 || status=1
      tail -50 "$OUT/bench.log"
      python benchmarks/targets.py "$OUT/h200.json" > "$OUT/targets.md" && tail -1 "$OUT/targets.md" ;;
    pdl-ab)
      # The GEMV and the fused GEMM as programmatic dependent launches (JAX_FP4_PDL=1) against plain
      # launches: their GPU tests, then the bench's rows (PDL_M, PDL_SHAPES) and decode step with
      # the flag 0, 1, 0 (the two plain runs show the drift within the call), compared by
      # ab_compare.py. JSON per run: pdl_ab_<i>_base.json (flag 0) / pdl_ab_<i>_new.json (flag 1).
      timeout 150 python -m pytest -q -m gpu tests/test_gpu_kernels.py tests/test_gpu_fused.py \
        -k "programmatic or PDL" 2>&1 | tail -3 | tee "$OUT/pdl_ab.log"
      i=0
      for flag in 0 1 0; do
        i=$((i + 1))
        side=$([ "$flag" = 1 ] && echo new || echo base)
        echo "== $i JAX_FP4_PDL=$flag" | tee -a "$OUT/pdl_ab.log"
        JAX_FP4_PDL=$flag timeout 200 python -m bench --layout tiled --m "${PDL_M:-1,8,32,64}" \
          --shapes "${PDL_SHAPES:-11008x4096,4096x11008,17408x5120}" --decode-step \
          --json "$OUT/pdl_ab_${i}_$side.json" 2>&1 | grep -E "^ +[0-9]+x|jax_fp4 \(|bf16 jnp" \
          | tee -a "$OUT/pdl_ab.log" || status=1
      done
      python benchmarks/ab_compare.py "$OUT"/pdl_ab_*_*.json | tee -a "$OUT/pdl_ab.log" || status=1 ;;
    dispatch-check)
      # Issue 7's dispatch target by the bench's method: per row every backend forced and auto's
      # pick, the verdict within 5% (benchmarks/dispatch_check.py). DISPATCH_LAYOUT (default tiled),
      # DISPATCH_SHAPES / DISPATCH_M (the script's defaults: the four prefill shapes, M = 1-4096).
      # DISPATCH_NAME (default dispatch_check): the output files' name, for several runs in a call.
      name=${DISPATCH_NAME:-dispatch_check}
      timeout "${DISPATCH_TIMEOUT:-540}" python benchmarks/dispatch_check.py --layout "${DISPATCH_LAYOUT:-tiled}" \
        ${DISPATCH_SHAPES:+--shapes "$DISPATCH_SHAPES"} ${DISPATCH_M:+--m "$DISPATCH_M"} \
        ${DISPATCH_BACKENDS:+--backends "$DISPATCH_BACKENDS"} \
        --json "$OUT/$name.json" > "$OUT/$name.md" 2> "$OUT/$name.log" || status=1
      tail -1 "$OUT/$name.md" ;;
    xla-fusion)
      # The xla path's compiled program on this GPU: Triton GEMM / cuBLAS, weight materialized or not.
      timeout 240 python benchmarks/xla_fusion_check.py --layout "${DISPATCH_LAYOUT:-tiled}" \
        ${DISPATCH_SHAPES:+--shapes "$DISPATCH_SHAPES"} ${DISPATCH_M:+--m "$DISPATCH_M"} \
        --json "$OUT/xla_fusion.json" 2>&1 | tee "$OUT/xla_fusion.md" || status=1 ;;
    profile)
      # --replay-mode application: kernel replay backs up device memory and crawls on big weights.
      timeout 150 ncu --clock-control none --replay-mode application -k regex:Fused -c 2 \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section SchedulerStats python benchmarks/profile_kernels.py \
        --cases fused:16:11008x4096,fused:128:11008x4096 > "$OUT/ncu_fused.log" 2>&1 || status=1
      grep -E "FusedGemm|Duration|Grid Size|Cluster Size|Registers Per|Achieved Occupancy|DRAM Th|Compute \(SM\) Th|Issued Warp|Max Active Clusters|Waves" \
        "$OUT/ncu_fused.log" | cut -c1-150 ;;
    gemv-sweep)
      # GEMV launch configs (JAX_FP4_GEMV_CONFIG="col_tiles,k_split[,rows]") against the
      # heuristic's pick (empty).
      for cfg in "" 1,2 1,3 1,4 1,6 1,8 2,2 2,3 2,4 2,8; do
        echo "== M=1,8 col_tiles,k_split = ${cfg:-heuristic}"
        JAX_FP4_GEMV_CONFIG=$cfg timeout 60 python -m bench --backend gemv --m 1,8 --repeats 5 --layout "${BENCH_LAYOUT:-tiled}" \
          --shapes 11008x4096,4096x11008,17408x5120,5120x17408,28672x8192 2>&1 | grep -E "^ +[0-9]+x" | cut -c1-60
      done | tee "$OUT/gemv_sweep.log"
      for cfg in "" 1,1 1,2 1,4 2,1 2,2; do
        echo "== lm_head M=4 col_tiles,k_split = ${cfg:-heuristic}"
        JAX_FP4_GEMV_CONFIG=$cfg timeout 40 python -m bench --backend gemv --m 4 --repeats 5 --layout "${BENCH_LAYOUT:-tiled}" \
          --shapes 248320x2048 2>&1 | grep -E "^ +[0-9]+x" | cut -c1-60
      done | tee -a "$OUT/gemv_sweep.log" ;;
    probe)
      # Which limit holds the GEMV back (benchmarks/probes/gemv_probe.cu; built by the build stage).
      probe=$(ls build/*/gemv_probe 2>/dev/null | head -1)
      if [ -z "$probe" ]; then echo "gemv_probe not built: run the build stage first" >&2; status=1; continue; fi
      timeout 120 "$probe" ${PROBE_SHAPES:-11008x4096 4096x11008 17408x5120 28672x8192} 2>&1 | tee "$OUT/gemv_probe.log" ;;
    gemv-configs)
      # Every launch config of the prepacked GEMV at M = 1, 2, 4, 8, 12, 16 (kernel-only times,
      # the heuristic's pick starred): what gemv_launch_config rests on. Default shapes: the
      # bench's decode shapes, then the decode step's own (qkv, gate/up, down).
      probe=$(ls build/*/gemv_probe 2>/dev/null | head -1)
      if [ -z "$probe" ]; then echo "gemv_probe not built: run the build stage first" >&2; status=1; continue; fi
      GEMV_PROBE_SWEEP_M=${SWEEP_M:-1,2,4,8,12,16} timeout 240 "$probe" \
        ${PROBE_SHAPES:-11008x4096 4096x11008 17408x5120 5120x17408 28672x8192 248320x2048 4096x4096 6144x4096 24576x4096 4096x12288} 2>&1 | tee "$OUT/gemv_configs.log" ;;
    gemv-profile)
      # Stall reasons per SASS instruction of the probe's GEMV kernels (one launch each, M = 1,
      # 11008x4096), plus the SASS of the probe binary.
      probe=$(ls build/*/gemv_probe 2>/dev/null | head -1)
      if [ -z "$probe" ]; then echo "gemv_probe not built: run the build stage first" >&2; status=1; continue; fi
      cuobjdump -sass "$probe" > "$OUT/gemv_probe.sass" 2>&1 || true
      for row in ${PROFILE_ROWS:-gemv}; do
        GEMV_PROBE_ROWS=$row timeout 120 ncu --clock-control none -k regex:GemvMmaKernel \
          --launch-skip 2 -c 1 --section WarpStateStats --section SchedulerStats --section InstructionStats \
          --section Occupancy --section LaunchStats --section SpeedOfLight --section SourceCounters \
          --page details --print-details all -o "$OUT/ncu_$row" "$probe" 11008x4096 > "$OUT/ncu_$row.log" 2>&1 || status=1
        ncu -i "$OUT/ncu_$row.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_${row}_sass.csv" 2>&1 || true
        rm -f "$OUT/ncu_$row.ncu-rep"
        grep -E "Duration|Registers Per|Achieved Active Warps|Issued Warp|No Eligible|Executed Ipc|Stall|Warp Cycles Per Issued" "$OUT/ncu_$row.log" | cut -c1-150 | head -30
      done ;;
    kernel-tests)
      timeout 240 python -m pytest -q -m gpu tests/test_gpu_kernels.py > "$OUT/gpu_kernel_tests.log" 2>&1 || status=1
      tail -5 "$OUT/gpu_kernel_tests.log" ;;
    fused-sweep)
      # Split-K factors of the fused GEMM (JAX_FP4_FUSED_SPLIT) against ChooseSplit's pick.
      for split in ${FUSED_SPLITS:-auto 1 2 3 4 6 8}; do
        echo "== JAX_FP4_FUSED_SPLIT=$split"
        [ "$split" = auto ] && split=""
        JAX_FP4_FUSED_SPLIT=$split timeout 90 python benchmarks/fused_timing.py --variants fused \
          --shapes 11008x4096,28672x8192 --ms 16,64,128 --json "$OUT/fused_split_${split:-auto}.json" \
          2>&1 | grep -E "^ +[0-9]+ +[0-9]+ +[0-9]+ \|"
      done | tee "$OUT/fused_sweep.log" ;;
    fused-tiles)
      # Activation rows per CTA of the fused GEMM (JAX_FP4_FUSED_TILE_M) against DefaultTileM's
      # pick, with bf16 jnp.dot and the GEMV in the same runs.
      for tile in ${FUSED_TILES:-auto 16 32 64}; do
        echo "== JAX_FP4_FUSED_TILE_M=$tile"
        [ "$tile" = auto ] && tile=""
        JAX_FP4_FUSED_TILE_M=$tile timeout 150 python benchmarks/fused_timing.py --variants ${FUSED_TILE_VARIANTS:-bf16,fused,gemv} \
          --ms ${FUSED_TILE_MS:-16,32,48,64} --json "$OUT/fused_tile_${tile:-auto}.json" \
          2>&1 | grep -E "^ +[0-9]+ +[0-9]+ +[0-9]+ \|"
      done | tee "$OUT/fused_tiles.log" ;;
    fused-crossovers)
      # What the dispatch thresholds of jax_fp4/dispatch.py rest on: the GEMV against the fused
      # GEMM at M = 9..16, and the fused GEMM against dequantize + cuBLAS at M = 256..1024.
      { timeout 150 python benchmarks/fused_timing.py --variants bf16,fused,gemv --ms 9,12,16 \
          --json "$OUT/crossovers_small_m.json"
        timeout 200 python benchmarks/fused_timing.py --variants bf16,dequant16,fused --ms 256,512,1024 \
          --json "$OUT/crossovers_large_m.json"; } 2>&1 | grep -E "^ +[0-9]+ +[0-9]+ +[0-9]+ \|" | tee "$OUT/crossovers.log" ;;
    fused-profile)
      # Stall reasons per SASS instruction of the fused GEMM, one launch per case (kernel replay;
      # no preallocated pool, so that ncu saves and restores only the live buffers).
      # PROFILE_LAYOUT=tiled profiles prepacked weights (the default sweep's layout);
      # PROFILE_KERNEL=GemvMma with gemv:M:NxK cases profiles the GEMV the same way.
      for case in ${FUSED_PROFILE_CASES:-fused:16:11008x4096 fused:64:11008x4096}; do
        name=ncu_$(echo "$case" | tr ':' '_')
        XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 ncu --clock-control none -k "regex:${PROFILE_KERNEL:-FusedGemm}" \
          --launch-skip 2 -c 1 --section WarpStateStats --section SchedulerStats --section InstructionStats \
          --section Occupancy --section LaunchStats --section SpeedOfLight --section SourceCounters \
          --section MemoryWorkloadAnalysis --page details --print-details all -o "$OUT/$name" \
          python benchmarks/profile_kernels.py --cases "$case" --layout "${PROFILE_LAYOUT:-spec}" > "$OUT/$name.log" 2>&1 || status=1
        ncu -i "$OUT/$name.ncu-rep" --page source --print-source sass --csv > "$OUT/${name}_sass.csv" 2>&1 || true
        rm -f "$OUT/$name.ncu-rep"
        python benchmarks/ncu_sass_summary.py "$OUT/${name}_sass.csv" > "$OUT/${name}_sass_summary.txt" 2>&1 || true
        grep -E "Duration|Registers Per|Achieved Active Warps|Issued Warp|No Eligible|Executed Ipc|Stall|Warp Cycles Per Issued|Grid Size|Cluster Size" "$OUT/$name.log" | cut -c1-150 | head -30
        head -8 "$OUT/${name}_sass_summary.txt"
      done ;;
    fused-tile-n)
      # 128 against 256 weight rows per CTA at the 128-row activation tile (JAX_FP4_FUSED_TILE_N):
      # the M = 65-128 decomposition experiment of NOTES_fused.md, "Thirteenth session".
      # FUSED_TILE_N_SPLITS: split-K factors forced on both tiles (JAX_FP4_FUSED_SPLIT), auto = ChooseSplit.
      for split in ${FUSED_TILE_N_SPLITS:-auto}; do
        echo "== JAX_FP4_FUSED_SPLIT=$split"
        [ "$split" = auto ] && split=""
        JAX_FP4_FUSED_SPLIT=$split timeout 200 python benchmarks/fused_timing.py --variants bf16,fused,fused_tile_n128 \
          --ms ${FUSED_TILE_N_MS:-80,128} --json "$OUT/fused_tile_n_split_${split:-auto}.json" 2>&1 | grep -E "^ +[0-9]+ +[0-9]+ +[0-9]+ \|"
      done | tee "$OUT/fused_tile_n.log" ;;
    stream-k)
      # Stream-K against cluster split-K for the warp-specialized kernel (JAX_FP4_FUSED_STREAM_K),
      # with the heuristic's pick (fused) and bf16 jnp.dot in the same run; FUSED_LAYOUT=tiled times
      # prepacked weights (the layout the default sweep uses).
      timeout 300 python benchmarks/fused_timing.py --layout "${FUSED_LAYOUT:-spec}" --variants bf16,fused,fused_cluster,fused_stream_k \
        --ms ${STREAM_K_MS:-80,128,192,256,512,1024} --json "$OUT/stream_k.json" 2>&1 \
        | grep -E "^ +[0-9]+ +[0-9]+ +[0-9]+ \|" | tee "$OUT/stream_k.log" ;;
    first)
      # The first call prepared for the next session with an H200 (benchmarks/NOTES.md, "Next" of
      # the thirty-fifth session), ~6 min: the build; auto at the dispatch rules' edges against the
      # float64 reference; the LLM example at batch 1 (the thirty-fourth session's one 7.43 ms run:
      # its 16-step windows tell a stall from the rate); the two small-weight GEMV rules, measured
      # on an H100 and the spec layout only, on both layouts at the sizes around their bounds.
      bash "$0" build || exit 1
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python -m pytest -q -m gpu tests/test_gpu_matmul.py \
        -k rule_edges > "$OUT/rule_edges.log" 2>&1 || status=1
      tail -4 "$OUT/rule_edges.log"
      LLM_RUNS=1 bash "$0" llm || status=1
      for layout in spec tiled; do
        DISPATCH_NAME=dispatch_check_$layout DISPATCH_TIMEOUT=200 DISPATCH_LAYOUT=$layout \
          DISPATCH_SHAPES=1024x8192,1536x4096,2048x2048,2048x4096,3072x4096 DISPATCH_M=17,32,64 \
          bash "$0" dispatch-check || status=1
      done ;;
    llm)
      # End to end: examples/llm_generate.py on random Llama-3-8B-shaped weights, NVFP4
      # (jax_fp4) against the same weights in bf16 (XLA's dot), batch 1 and 8, 64 new tokens; and
      # batch 1 with the layers stacked under lax.scan. JSON per run: $OUT/llm_generate_b<batch>.json.
      # LLM_RUNS: the runs, ';'-separated (default "1;8;1 --scan-layers").
      : > "$OUT/llm_generate.log"
      IFS=';' read -r -a runs <<< "${LLM_RUNS:-1;8;1 --scan-layers}"
      for run in "${runs[@]}"; do
        echo "== batch $run" | tee -a "$OUT/llm_generate.log"
        name=$(echo "$run" | tr -d ' -' | sed 's/scanlayers/_scan/')
        timeout 200 python examples/llm_generate.py --random llama3-8b --batch $run --max-new-tokens 64 \
          --compare-bf16 --json "$OUT/llm_generate_b$name.json" \
          2>&1 | tee -a "$OUT/llm_generate.log" | grep -E "NVFP4|bf16|path" || status=1
      done ;;
    llm-ab)
      # The example against an earlier version of itself (LLM_AB_BASE, a copy of the file that
      # travels untracked, e.g. `git show REV:examples/llm_generate.py > examples/ab_base_llm_generate.py`),
      # NVFP4 only, at long contexts where the KV cache and attention weigh: batch 8 with 1024
      # new tokens, batch 1 with 2048. JSON: $OUT/llm_ab_<base|new>_b<batch>.json.
      : > "$OUT/llm_ab.log"
      for run in "8 1024" "1 2048"; do
        read -r batch new_tokens <<< "$run"
        for side in base new; do
          script=examples/llm_generate.py
          [ "$side" = base ] && script=${LLM_AB_BASE:?LLM_AB_BASE names the base version}
          echo "== $side: batch $batch, $new_tokens new tokens" | tee -a "$OUT/llm_ab.log"
          timeout 170 python "$script" --random llama3-8b --batch "$batch" --max-new-tokens "$new_tokens" \
            --json "$OUT/llm_ab_${side}_b$batch.json" 2>&1 | tee -a "$OUT/llm_ab.log" | grep -E "NVFP4|Error" || status=1
        done
      done ;;
    llm-flags)
      # The Llama-3-8B-shaped decode step (batch 1, unrolled layers) under XLA's default command
      # buffers, with none, and with every kind but custom calls. JSON: $OUT/llm_flags_<i>.json.
      i=0
      for flags in "" "--xla_gpu_enable_command_buffer=" "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT"; do
        i=$((i + 1))
        echo "== XLA_FLAGS=$flags" | tee -a "$OUT/llm_flags.log"
        XLA_FLAGS="$flags" timeout 150 python examples/llm_generate.py --random llama3-8b --batch 1 \
          --max-new-tokens 40 --compare-bf16 --json "$OUT/llm_flags_$i.json" \
          2>&1 | tee -a "$OUT/llm_flags.log" | grep -E "NVFP4|bf16" || status=1
      done ;;
    llm-profile)
      # The decode step's GPU busy time against its wall time and the host's longest events
      # (benchmarks/probes/llm_step_host.py), with XLA's default command buffers and with none.
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python benchmarks/probes/llm_step_host.py \
        --json "$OUT/llm_profile_default.json" 2>&1 | tee "$OUT/llm_profile.log" | grep -v "^W" || status=1
      XLA_FLAGS=--xla_gpu_enable_command_buffer= XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 \
        python benchmarks/probes/llm_step_host.py --json "$OUT/llm_profile_no_cmd_buffer.json" \
        2>&1 | tee -a "$OUT/llm_profile.log" | grep -v "^W" || status=1 ;;
    fused-tests)
      timeout 240 python -m pytest -q -m gpu tests/test_gpu_fused.py > "$OUT/gpu_fused_tests.log" 2>&1 || status=1
      tail -5 "$OUT/gpu_fused_tests.log" ;;
    *)
      echo "unknown stage $stage (build, fused-ab, tests, suite, multi-gpu, sanitizer, fused, bench, pdl-ab, dispatch-check, xla-fusion, profile, gemv-sweep, probe, gemv-configs, gemv-profile, kernel-tests, fused-sweep, fused-tiles, fused-crossovers, fused-profile, fused-tile-n, stream-k, first, fused-tests, llm, llm-ab, llm-flags, llm-profile)" >&2; exit 2 ;;
  esac
done
exit $status
