#!/usr/bin/env bash
# One device call: install, then the named steps in order, each under its own time limit, logs under $OUT.
# Run on the GPU machine:  STEPS="backends bench" bash scripts/gpu_run.sh
# Steps: tune, backends (every backend against its reference at 8B shapes), bench (autodeploy bench at
# 1/32/256 against hf-eager and hf-compile in the same run), bench_alone (the same without baselines, AD_SET
# applied), generate (scripts/bench_gpu_generate.py),
# bench_quant (bench_alone once per scheme in $SCHEMES, default none fp8 int8_wo int4_wo; SCHEME+kv adds an fp8 KV cache), reload
# (scripts/reload_timing.py: build, save, reload in fresh processes, with the reload's phases), reload_phases
# (scripts/time_reload_phases.py: the graph's load and the weights' read alone and together, 4 – 16 readers),
# bench_eager (autodeploy bench with compile.backend=none, no baselines), tests (the files in $TESTS),
# profile (scripts/profile_engine_step.py at $PROFILE_B, default 1,256), suite (the whole test suite on the GPU, 12 workers),
# serve (1,024 requests, at most 256 in flight, 128 in / 128 out), prefill (scripts/profile_prefill.py),
# build (scripts/time_build.py cold, then warm, over fresh cache folders), sweep (scripts/sweep_skinny_gemm.py;
# sweep_tma: its TMA launches with K splits),
# decode_attention (scripts/time_decode_attention.py $DECODE_ATTENTION_ARGS: fp8 for fp8 caches), burst (scripts/time_burst_steps.py at $BURST_B, default 32), sweep_quant (scripts/sweep_quantized_gemv.py over $SCHEMES_CSV).
# Limits: <STEP>_S, e.g. BENCH_S=420. Extra autodeploy settings for bench/generate/profile: AD_SET="--set k=v".
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export XDG_CACHE_HOME="${XDG_CACHE_HOME:-$OUT/cache}"  # the autotuner's decisions
python3 -m pip install -q --no-deps .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
step() { local name=$1 limit=$2; shift 2; echo "=== $name"; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "rc=$rc wall=$((SECONDS - t0))s"; tail -n ${TAIL:-30} "$OUT/$name.log" | cut -c1-300; }
MODEL=llama-3-8b
for s in ${STEPS:-backends bench}; do case $s in
  tune) AUTODEPLOY_CONFIG= step tune ${TUNE_S:-150} python3 -m autodeploy tune $MODEL --set weights=random ${AD_SET:-} ;;
  backends) step backends ${BACKENDS_S:-120} python3 -m pytest -q -p no:cacheprovider -n 8 \
      tests/custom_ops/test_backends_gpu.py tests/custom_ops/test_cutlass_backend.py tests/custom_ops/test_paged_attention_triton.py ;;
  bench) AUTODEPLOY_CONFIG= step bench ${BENCH_S:-420} python3 -m autodeploy bench $MODEL --set weights=random ${AD_SET:-} \
      --batch ${BATCHES:-1,32,256} --input-len 128 --output-len 128 --repeats 1 --compare ${COMPARE:-hf-eager,hf-compile} \
      --no-progress --out "$OUT/bench.json" ;;
  bench_alone) AUTODEPLOY_CONFIG= step bench_alone ${BENCH_S:-420} python3 -m autodeploy bench $MODEL --set weights=random ${AD_SET:-} \
      --batch ${BATCHES:-1,32,256} --input-len 128 --output-len 128 --repeats 1 --no-progress --out "$OUT/bench_alone.json" ;;
  bench_quant) for scheme in ${SCHEMES:-none fp8 int8_wo int4_wo}; do kv=; [[ $scheme == *+kv ]] && kv="--set quantize.kv_cache=fp8"
      AUTODEPLOY_CONFIG= step bench_$scheme ${BENCH_S:-300} \
      python3 -m autodeploy bench $MODEL --set weights=random --set quantize.default=${scheme%+kv} $kv ${AD_SET:-} \
      --batch ${BATCHES:-1,32,256} --input-len 128 --output-len 128 --repeats 1 --no-progress --out "$OUT/bench_$scheme.json"; done ;;
  reload_phases) AUTODEPLOY_CONFIG= step reload_phases ${RELOAD_S:-300} python3 scripts/time_reload_phases.py $MODEL --set weights=random ${AD_SET:-} ;;
  reload) AUTODEPLOY_CONFIG= step reload ${RELOAD_S:-300} python3 scripts/reload_timing.py $MODEL --repeats 1 --set weights=random ${AD_SET:-} ${RELOAD_ARGS:-} ;;
  bench_eager) AUTODEPLOY_CONFIG= step bench_eager ${BENCH_S:-420} python3 -m autodeploy bench $MODEL --set weights=random \
      --set compile.backend=none --batch ${BATCHES:-1,32,256} --input-len 128 --output-len 128 --repeats 1 --no-progress \
      --out "$OUT/bench_eager.json" ;;
  tests) step tests ${TESTS_S:-180} python3 -m pytest -q -p no:cacheprovider -n 8 ${TESTS:-tests/runtime/test_cuda_graphs.py} ;;
  generate) AUTODEPLOY_CONFIG= step generate ${GENERATE_S:-240} python3 scripts/bench_gpu_generate.py $MODEL ${BATCHES:-1,32,256} ;;
  profile) AUTODEPLOY_CONFIG= step profile ${PROFILE_S:-120} python3 scripts/profile_engine_step.py ${PROFILE_B:-1,256} ${AD_SET:-} ;;
  serve) AUTODEPLOY_CONFIG= step serve ${SERVE_S:-300} python3 -m autodeploy bench $MODEL --set weights=random ${AD_SET:-} \
      --workload concurrency --concurrency 256 --num-requests 1024 --input-dist fixed:128 --output-dist fixed:128 \
      --repeats 1 --no-progress --out "$OUT/serve.json" ;;
  prefill) AUTODEPLOY_CONFIG= step prefill ${PREFILL_S:-200} python3 scripts/profile_prefill.py 4096 ${AD_SET:-} ;;
  build) rm -rf /tmp/build-cache; for pass in cold warm; do AUTODEPLOY_CONFIG= XDG_CACHE_HOME=/tmp/build-cache \
      TRITON_CACHE_DIR=/tmp/build-cache/triton step build_$pass ${BUILD_S:-240} python3 scripts/time_build.py; done ;;
  sweep) step sweep ${SWEEP_S:-240} python3 scripts/sweep_skinny_gemm.py ${ROWS:-1,32} ;;
  sweep_tma) step sweep_tma ${SWEEP_S:-300} python3 scripts/sweep_skinny_gemm.py tma ${ROWS:-32} ;;
  sweep_quant) step sweep_quant ${SWEEP_S:-300} python3 scripts/sweep_quantized_gemv.py ${SCHEMES_CSV:-int8_wo,int4_wo,fp8} ;;
  burst) AUTODEPLOY_CONFIG= step burst ${BURST_S:-180} python3 scripts/time_burst_steps.py ${BURST_B:-32} 3 ${AD_SET:-} ;;
  decode_attention) step decode_attention ${DECODE_ATTENTION_S:-120} python3 scripts/time_decode_attention.py ${DECODE_ATTENTION_ARGS:-} ;;
  suite) step suite ${SUITE_S:-420} python3 -m pytest -q -p no:cacheprovider -n 12 ;;
  *) echo "unknown step $s" ;;
esac; done
