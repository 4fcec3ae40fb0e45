#!/usr/bin/env bash
# One call on the GPU machine: kernel tests, engine tests (the triton backend is the CUDA
# default), then the benchmark workloads of docs/performance.md. Tables land in $OUT.
# Usage there: bash scripts/gpu_session.sh [regress|spec|spec-adaptive|spec-copier|spec-copier-tpN|spec-random|w1-spec|w2-spec|kernels|extend|gpu|engine|issue7|tp|w2-tpN|w1-dpN|
#   prefix-dpN|prefix-rr-dpN|l70-tpN|l70-fp8-tpN|flow-dp|flow-prefix|flow-paths|flow-prefix-profile|splits|w1|w1-steps|stream-overlap|fp8-gemm|fp8-act|extend-tiles|extend-fp8|extend-shared|prefill-attn|prefill-attn-long|prefill|trtllm-two|prefix-steps|trtllm-steps|trtllm-steps-long|trtllm-steps-20k|trtllm-steps-tail|trtllm-rest|trtllm-decode|trtllm-long|trtllm-per-token|trtllm-full:SHAPE,SHAPE|trtllm-fifth:SHAPE,SHAPE|trtllm-chunks:SIZE,SIZE|trtllm-fp8-prefill|prefix-decode|prefix-decode-tiles|prefix-stage-tiles|prefix-decode-heads|prefix-variants|w1-fp8-steps|w2-fp8-steps|w2-steps|w1-profile|w2|w2-tp2|flashinfer|w1-flashinfer|w1-peer|prefix|prefix-on|fewshot-on|prefix-plain|prefix-profile|fewshot|queue|queue-profile|latency|startup|lora|w1-lora|fp8|fp8-kernels|fp8-splits|fp8-one-split|fp8-large|fp8-long|vl|vl-bench|vl-profile|fp8-accuracy|fp8-decode|fp8-decode-mix|w1-fp8|w2-fp8|w2-fp8kv ...]
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/gristmill-out}
mkdir -p "$OUT"
if [ -d .whl ]; then  # pyzmq travels as a wheel: the machine has no network
  # (.pfw: Prefect and what it needs beyond the image, for the flows: carry it when a step runs one)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl $(ls .pfw/*.whl 2>/dev/null)
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
# The image sets PYTHONDONTWRITEBYTECODE=1: without this, every process would compile Prefect and
# gristmill from source (import prefect: 3.8 s, against 1.4-1.9 s compiled), where a user's
# `pip install` compiles at install time and Python caches the rest on its first import.
python3 -m compileall -q -j 16 /tmp/site flows engine kernels bench deployments demo >/dev/null 2>&1
if [ -f .fi/flashinfer-slim.tgz ]; then  # optional: FlashInfer unpacked beside the wheels
  mkdir -p /tmp/site && tar xzf .fi/flashinfer-slim.tgz -C /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .fi/*.whl 2>&1 | grep -v WARNING
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# Triton's compiled kernels: kept in the tree's ignored .triton-cache, which a call can carry
# in and (KEEP_TRITON_CACHE=1) bring back as $OUT/triton-cache.tgz (same image, same sm_90)
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
# A pytest step keeps its whole log in $OUT/<step>.log and prints its failures and its count;
# TEST_TIMEOUT (s) ends a step that hangs, so the steps after it still run within the call.
tests() {
  timeout -k 10 "${TEST_TIMEOUT:-3600}" python3 -m pytest "$@" -q -p no:cacheprovider -W ignore >"$OUT/$s.log" 2>&1 \
    || { [ $? -ge 124 ] && echo "timed out after ${TEST_TIMEOUT:-3600} s" >>"$OUT/$s.log"; }
  grep -E "^(ERROR|FAILED)|^E  |passed|failed|error" "$OUT/$s.log" | tail -25
}
# A benchmark step: bench's table (python -m bench), also as $OUT/<step>.json (which `regress` sums up).
bench() {
  python3 -m bench "$@" --json "$OUT/$s.json" 2>&1 | grep "^|\|Error\|error"
}
# The preset's lines as each shape ends: line-buffered, so a call cut short by its time limit
# still brings back the shapes that finished (in $OUT/session.log when the caller tees to it)
per_shape() { grep --line-buffered "^|\|Error\|requests in"; }
W1="--model-config qwen3-0.6b --num-prompts 256 --input-len 100:1024 --output-len 100:1024"
W2="--model-config llama-3.1-8b --num-prompts 1000 --input-len 1024 --output-len 256"
PREFIX="--model-config qwen3-0.6b --num-prompts 1000 --shared-prefix-len 2000 --input-len 50 --output-len 64"
L70="--model-config llama-3.1-70b --num-prompts 256 --input-len 1024 --output-len 256"
GPUS=$(nvidia-smi -L | wc -l)
# The regression run's table: each pytest step's count and each benchmark's time and floor.
summary() {
  python3 - "$OUT" "$@" <<'PY'
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| step | result | wall (s) | output tok/s | fraction of floor |\n| --- | --- | --- | --- | --- |")
for step in sys.argv[2:]:
    if (out / f"{step}.json").is_file():
        r = json.loads((out / f"{step}.json").read_text())
        print(f"| {step} | {r['device']} | {r['wall time (s)']} | {r['output tok/s']} | {r['fraction of floor']} |")
    elif (out / f"{step}.log").is_file():
        tail = (out / f"{step}.log").read_text().strip().splitlines()[-1:] or ["(empty log)"]
        print(f"| {step} | {re.sub(r'=+', '', tail[0]).strip()} | | | |")
    else:
        print(f"| {step} | not run | | | |")
PY
}
# The scheduler's profile: by own time, then by cumulative time within engine/ (where a step goes).
profile() {
  python3 -c "import pstats,sys; s=pstats.Stats(sys.argv[1]); s.sort_stats('tottime').print_stats(25); s.sort_stats('cumulative').print_stats('engine/', 45)" "$1" \
    | grep -v "^$" | sed 's|/.*/engine/|engine/|' | tail -80
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
run_step() {
    local s=$1
    echo "=== $s ($(date -u +%H:%M:%S))"
    case $s in
      kernels) tests tests/kernels ;;
      # suffixes over a shared prefix: over the pool, or engine/attention/shared_extend.py's launches
      extend-shared) python3 -m bench.extend_tiles --shared 2>&1 | grep "^|\|Error" ;;
      extend) tests tests/kernels/test_extend_attention.py -m gpu -s ;;
      gpu) tests tests/engine/test_gpu_path.py tests/engine/test_generate_vs_transformers.py \
             tests/engine/test_shared_prefix_decode.py::test_gpu_grouped_decode_equals_cpu_reference \
             tests/engine/test_shared_extend.py::test_gpu_grouped_extend_equals_cpu_reference \
             tests/engine/test_spec_verify.py tests/kernels/test_verify_attention.py \
             tests/engine/test_speculative.py::test_greedy_on_the_gpu_equals_decoding_without_speculation \
             tests/engine/test_spec_standalone.py::test_greedy_on_the_gpu_equals_decoding_without -n 8 ;;
      # speculative decoding: NGRAM against no speculation at batch 1 to 256 (bench/speculative.py)
      spec) python3 -m bench.speculative --model-config qwen3-0.6b --batch 1 16 64 256 --input-len 1000 \
                --output-len 200 --json "$OUT/spec.json" 2>&1 | grep "^|\|Error" ;;
      # the adaptive policy alone against no speculation (its VERIFY_GAIN table's check)
      spec-adaptive) python3 -m bench.speculative --model-config qwen3-0.6b --batch 1 16 64 256 --input-len 1000 \
                --output-len 200 --modes off ngram --json "$OUT/spec-adaptive.json" 2>&1 | grep "^|\|Error" ;;
      # the extraction shape: a model whose output copies its prompt (bench/copier.py), batch 256 up
      spec-copier) python3 -m bench.speculative --model-config qwen3-0.6b --copier --batch 1 16 64 256 --input-len 1000 \
                --output-len 200 --json "$OUT/spec-copier.json" 2>&1 | grep "^|\|Error" ;;
      # the same with nothing to accept (sampled outputs of dummy weights are random tokens)
      spec-random) python3 -m bench.speculative --model-config qwen3-0.6b --batch 16 256 --input-len 1000 \
                --output-len 200 --temperature 1 --modes off ngram --json "$OUT/spec-random.json" 2>&1 | grep "^|\|Error" ;;
      # STANDALONE: the target as its own draft and a dummy draft of 1/8 the layers, adaptive and always
      spec-standalone) python3 -m bench.speculative --model-config qwen3-0.6b --batch 1 16 64 256 --input-len 1000 \
                --output-len 200 --modes off standalone standalone-always standalone-eighth standalone-eighth-always --json "$OUT/spec-standalone.json" 2>&1 | grep "^|\|Error" ;;
      spec-standalone-adaptive) python3 -m bench.speculative --model-config qwen3-0.6b --batch 1 16 64 256 --input-len 1000 \
                --output-len 200 --modes off standalone standalone-eighth --json "$OUT/spec-standalone.json" 2>&1 | grep "^|\|Error" ;;
      # TensorRT-LLM's published shapes (bench/trtllm.py): the four of issue 39 first, a fifth of
      # each request count (the ten at full counts take about an hour: `python -m bench --preset trtllm`)
      trtllm) python3 -m bench --preset trtllm --scale 0.2 --shapes 1000/1000 2048/128 128/128 500/2000 \
                --json "$OUT/trtllm.json" 2>&1 | per_shape ;;
      # ...and the other six (about 8 minutes of an H200 at a tenth: 20000/2000 alone about 2)
      trtllm-rest) python3 -m bench --preset trtllm --scale 0.1 --shapes 128/2048 128/4096 1000/2000 \
                2048/2048 5000/500 20000/2000 --json "$OUT/trtllm-rest.json" 2>&1 | per_shape ;;
      # the decode-heavy four at a fifth of the counts, shortest first: more requests decode at
      # once than at a tenth (150). At 0.4, 128/4096 alone ran past 5 minutes of an H200.
      trtllm-decode) python3 -m bench --preset trtllm --scale 0.2 --shapes 1000/2000 128/2048 2048/2048 \
                128/4096 --json "$OUT/trtllm-decode.json" 2>&1 | per_shape ;;
      # shapes at TensorRT-LLM's full request counts, e.g. trtllm-full:1000/2000,2048/2048 (a
      # decode-heavy shape at full count is 3-6 minutes of an H200: one or two a call)
      # (trtllm-fifth:SHAPE,SHAPE: the same at a fifth of the counts)
      trtllm-full:*|trtllm-fifth:*) local scale=1; [ "${s%%:*}" = trtllm-fifth ] && scale=0.2
                python3 -m bench --preset trtllm --scale $scale --shapes $(echo "${s#*:}" | tr , " ") \
                --json "$OUT/${s%%:*}.json" 2>&1 | per_shape ;;
      # the preset's dummy weights are a per-tensor static FP8 checkpoint (TensorRT-LLM's layout);
      # this is quantization="fp8" instead (per-channel and per-token scales), to set beside it
      trtllm-per-token) python3 -m bench --preset trtllm --scale 0.2 --fp8-checkpoint none \
                --shapes 2048/128 1000/1000 128/128 1000/2000 --json "$OUT/trtllm-per-token.json" \
                2>&1 | per_shape ;;
      # ...and the long prompts at a fifth (at a tenth 5000/500 took 22 s, 20000/2000 145 s):
      # with trtllm and trtllm-decode, the ten at a fifth in three calls of under 10 minutes
      trtllm-long) python3 -m bench --preset trtllm --scale 0.2 --shapes 5000/500 20000/2000 \
                --json "$OUT/trtllm-long.json" 2>&1 | per_shape ;;
      # the long prompts by chunk size, e.g. trtllm-chunks:8192,20480 (a tenth of the counts): a
      # chunk after the first attends over its earlier chunks gathered out of the float8 pool
      # (kernels/context_gather.py), the first over its own K/V; a step's budget at least the chunk
      trtllm-chunks:*) for chunk in $(echo "${s#trtllm-chunks:}" | tr , " "); do
                local budget=$(( chunk > 16384 ? chunk : 16384 ))
                python3 -m bench --preset trtllm --scale 0.1 --shapes 5000/500 20000/2000 --engine-args \
                  "{\"quantization\": \"fp8\", \"kv_cache_dtype\": \"fp8_e4m3\", \"mem_fraction_static\": 0.9, \"chunked_prefill_size\": $chunk, \"max_prefill_tokens\": $budget}" \
                  2>&1 | per_shape; done ;;
      # the prefill-heavy shapes with fresh prompts' attention products in 16 bits, then float8
      trtllm-fp8-prefill) for mode in null '"qk"' '"qk_pv"'; do
                python3 -m bench --preset trtllm --scale 0.1 --shapes 2048/128 5000/500 --engine-args \
                  "{\"quantization\": \"fp8\", \"kv_cache_dtype\": \"fp8_e4m3\", \"prefill_attention_fp8\": $mode}" \
                  2>&1 | per_shape; done ;;
      w1-spec) bench $W1 --engine-args '{"speculative_algorithm": "NGRAM"}' ;;
      w2-spec) bench $W2 --engine-args '{"speculative_algorithm": "NGRAM"}' ;;
      engine) tests tests/engine/test_generate_vs_transformers.py tests/engine/test_runtime_api.py \
                tests/engine/test_prefix_cache_scheduling.py -n 8 ;;
      issue7) tests tests/engine/test_structured_output.py::test_engine_masks_on_the_gpu tests/engine/test_score.py \
                "tests/engine/test_gpu_path.py::test_bert_embeddings_on_the_gpu_match_sentence_transformers" ;;
      tp) tests tests/engine/test_tensor_parallel.py tests/engine/test_data_parallel.py -m gpu -s ;;
      # the regression run before resolving anything that touches engine/ or kernels/: the GPU
      # tests, the parallel ones where there are 2+ GPUs, W1, W2 and the shared-prefix pair
      regress) local steps="gpu w1 w2 prefix-on prefix-off" step
               [ "$GPUS" -ge 2 ] && steps="gpu tp w1 w2 prefix-on prefix-off"
               for step in $steps; do run_step "$step" >/dev/null; done
               summary $steps ;;
      # the extraction shape with tensor parallelism (every rank verifies the leader's drafts)
      spec-copier-tp[0-9]*) python3 -m bench.speculative --model-config qwen3-0.6b --copier --batch 16 256 \
                --input-len 1000 --output-len 200 --modes off ngram --engine-args "{\"tp_size\": ${s#spec-copier-tp}}" \
                --json "$OUT/$s.json" 2>&1 | grep "^|\|Error" ;;
      w2-tp[0-9]*) bench $W2 --engine-args "{\"tp_size\": ${s#w2-tp}}" ;;
      w1-dp[0-9]*) bench $W1 --engine-args "{\"dp_size\": ${s#w1-dp}}" ;;
      prefix-dp[0-9]*) bench $PREFIX --engine-args "{\"dp_size\": ${s#prefix-dp}}" ;;
      prefix-rr-dp[0-9]*) bench $PREFIX --engine-args "{\"dp_size\": ${s#prefix-rr-dp}, \"load_balance_method\": \"round_robin\"}" ;;
      l70-tp[0-9]*) bench $L70 --engine-args "{\"tp_size\": ${s#l70-tp}}" ;;
      l70-fp8-tp[0-9]*) bench $L70 --engine-args "{\"tp_size\": ${s#l70-fp8-tp}, \"quantization\": \"fp8\"}" ;;
      flow-prefix) python3 -m bench.flow_prefix 2>&1 | tail -6 ;;
      flow-paths) python3 -m bench.flow_prefix --paths 2>&1 | grep "^|" ;;
      flow-prefix-profile) python3 -m bench.flow_prefix --profile $OUT/flow.prof 2>&1 | grep -v "^\[transformers\]" | tail -60 ;;
      flow-dp) python3 -m bench.flow_dp --rows 20000 --dp 1 "$GPUS" 2>&1 | tail -8 ;;
      # TensorRT-LLM's shapes (its FP8 checkpoint layout, FP8 K/V, fewer requests): each step's
      # device time against its floor, and the kernels of the first prefills and of 10 decodes;
      # trtllm-steps-long: the two nearest 1.0 that are not there yet
      # (trtllm-steps-20k: one wave of 20000/2000, the 83 requests the H200's pool holds at once)
      trtllm-steps|trtllm-steps-long|trtllm-steps-20k|trtllm-steps-tail) shapes=("300 1000 1000" "3000 128 128")
                [ "$s" = trtllm-steps-long ] && shapes=("500 2048 2048" "300 5000 500")
                local kv='"kv_cache_dtype": "fp8_e4m3"'
                [ "$s" = trtllm-steps-20k ] && shapes=("83 20000 2000") && kv="$kv, \"mem_fraction_static\": 0.9"
                # 20000/2000's last wave at a fifth of its count (200 = 2 x 83 + 34)
                [ "$s" = trtllm-steps-tail ] && shapes=("34 20000 2000") && kv="$kv, \"mem_fraction_static\": 0.9"
                for shape in "${shapes[@]}"; do set -- $shape
                python3 -m bench.profile_w1 --model-config llama-3.1-8b --num-prompts "$1" --input-len "$2" \
                  --output-len "$3" --fp8-checkpoint per-tensor-static --engine-args "{$kv}" \
                  --kernels 0:3,200:210 2>&1 | grep -v "^Loading\|Writing\|WARNING\|UserWarning\|_warn_once" \
                  | tee -a "$OUT/$s.log" | tail -70; done ;;
      # the shared-prefix pair's decode attention, one layer, by variant (bench/prefix_decode.py)
      prefix-decode) tests tests/kernels/test_shared_prefix_attention.py tests/kernels/test_decode_attention.py \
                tests/engine/test_shared_prefix_decode.py -m gpu
                python3 -m bench.prefix_decode 2>&1 | grep "^|\|^Hq" ;;
      prefix-decode-tiles) python3 -m bench.prefix_decode --tiles 2>&1 | grep "^|" ;;
      prefix-stage-tiles) python3 -m bench.prefix_decode --prefix-tiles 2>&1 | grep "^|" ;;
      # stage 1 with several kv heads a program over the bf16 cache: the pair (G 2), then W2's heads
      prefix-decode-heads) python3 -m bench.prefix_decode --heads 2>&1 | grep "^|"
                python3 -m bench.prefix_decode --heads --hq 32 --batch 1000 2>&1 | grep "^|" ;;
      # the pair's steps with each decode variant (bench.prefix_decode's), in process: as is,
      # graphs of short suffixes in 16-token tiles, two kv heads a stage-1 program; then W1's
      # steps as is and with the short-suffix graphs (which its plain batches must not replay)
      prefix-variants) SHORT="--set engine.attention.triton_backend._SHORT_SUFFIX_GRAPHS=True"
                for set in "" "$SHORT" "--set kernels.decode_attention._ROWS_PACKED_HEADS=2"; do
                echo "== the pair, ${set:-as is}"
                python3 -m bench.profile_w1 --num-prompts 1000 --shared-prefix-len 2000 --input-len 50 \
                  --output-len 64 --kernels "" $set 2>&1 | grep -v "^Loading\|Writing\|WARNING" | tail -14; done
                for set in "" "$SHORT"; do echo "== W1, ${set:-as is}"
                  python3 -m bench.profile_w1 --kernels "" $set 2>&1 | grep -v "^Loading\|Writing\|WARNING" | tail -14; done ;;
      # the shared-prefix pair's steps against their floors, kernels of the prefills and 10 decodes
      prefix-steps) python3 -m bench.profile_w1 --num-prompts 1000 --shared-prefix-len 2000 --input-len 50 \
                --output-len 64 --kernels 0:6,30:40 2>&1 | grep -v "^Loading\|Writing\|WARNING" | tail -70 ;;
      w1-steps) python3 -m bench.profile_w1 2>&1 | grep -v "^Loading\|Writing\|WARNING" | tee "$OUT/$s.log" | tail -60 ;;
      # W2's shape (bf16) on 300 requests: its prefill and decode steps against their floors
      # W2's decode layers as two half-batches on two streams: does attention overlap matmuls?
      stream-overlap) python3 -m bench.stream_overlap 2>&1 | grep "^|\|layers\|Error" ;;
      # Llama-3.1-8B's FP8 products by batch rows: cuBLAS's calls and kernels/fp8_matmul.py's tiles
      fp8-gemm) python3 -m bench.fp8_gemm 2>&1 | grep "^|\|layer\|Error" ;;
      # extend attention's tiles on the workloads' prefill batches (bench/extend_tiles.py)
      extend-tiles) python3 -m bench.extend_tiles 2>&1 | grep "^|\|Error" ;;
      extend-fp8) python3 -m bench.extend_tiles --fp8 2>&1 | grep "^|\|Error" ;;
      extend-gathered) python3 -m bench.extend_tiles --gathered 2>&1 | grep "^|\|Error" ;;
      prefill-attn) python3 -m bench.prefill_attention 2>&1 | grep "^|\|Error" ;;
      # ...on the long shapes' prompts: the default launch (Hopper: warp-specialized), two Triton tiles, cuDNN, flash
      prefill-attn-long) python3 -m bench.prefill_attention --batches 1x20000 1x8192 2x5000 1x5000 \
                --only default "no turns" "64x64, 4 warps, 3 stages" "128x128, 8 warps, 2" cudnn flash 2>&1 | grep "^|\|Error" ;;
      prefill) tests tests/kernels/test_prefill_attention.py tests/kernels/test_extend_attention.py \
                tests/kernels/test_context_gather.py -m gpu ;;
      trtllm-two) python3 -m bench --preset trtllm --scale 0.2 --shapes 2048/128 1000/1000 \
                --json "$OUT/trtllm-two.json" 2>&1 | per_shape ;;
      fp8-act) python3 -m bench.fp8_gemm --activation --rows 256 1280 4096 16384 2>&1 | grep "^|\|silu\|Error" ;;
      w2-steps) python3 -m bench.profile_w1 --model-config llama-3.1-8b --num-prompts 300 \
                --input-len 1024 --output-len 256 --kernels 0:2,150:160 \
                2>&1 | grep -v "^Loading\|Writing\|WARNING" | tee "$OUT/$s.log" | tail -50 ;;
      w1-fp8-steps) python3 -m bench.profile_w1 --engine-args '{"kv_cache_dtype": "fp8_e4m3"}' \
                2>&1 | grep -v "^Loading\|Writing\|WARNING" | tee "$OUT/$s.log" | tail -45 ;;
      w2-fp8-steps) python3 -m bench.profile_w1 --model-config llama-3.1-8b --num-prompts 256 \
                --len 1024 --kernels 0:2,300:310 --engine-args '{"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}' \
                2>&1 | grep -v "^Loading\|Writing\|WARNING" | tee "$OUT/$s.log" | tail -45 ;;
      flashinfer) tests tests/engine/test_flashinfer_backend.py tests/kernels/test_kv_indices.py -s ;;
      w1-flashinfer) python3 -m bench --model-config qwen3-0.6b --num-prompts 256 --input-len 100:1024 --output-len 100:1024 \
                --engine-args '{"attention_backend": "flashinfer"}' --json "$OUT/w1-flashinfer.json" 2>&1 | grep "^|\|Error" ;;
      splits) python3 -m bench.decode_splits 2>&1 | tail -8 ;;
      w1-profile) GRISTMILL_PROFILE=$OUT/w1.prof python3 -m bench --model-config qwen3-0.6b --num-prompts 256 --input-len 100:1024 --output-len 100:1024 2>&1 | grep "^|"
                  python3 -c "import pstats,sys; pstats.Stats(sys.argv[1]).sort_stats('tottime').print_stats(22)" "$OUT/w1.prof" | tail -32 ;;
      latency) python3 -m bench.run_latency --chat --imports --timeline 2>&1 | grep -v "^Loading\|WARNING" | tail -150 ;;
      startup) python3 -m bench.startup_phases 2>&1 | tail -30 ;;
      lora) tests tests/engine/test_lora.py tests/kernels/test_lora.py -s ;;
      w1-lora) python3 -m bench --model-config qwen3-0.6b --num-prompts 256 --input-len 100:1024 --output-len 100:1024 \
                --lora-adapters 4 --lora-rank 16 --json "$OUT/w1-lora.json" 2>&1 | grep "^|" ;;
      fp8) tests tests/kernels/test_fp8_kv.py tests/kernels/test_fp8_quant.py tests/engine/test_fp8_weights.py \
                tests/engine/test_fp8_gpu.py -s
           grep "^|" "$OUT/$s.log" ;;
      vl) tests tests/engine/test_vision_language.py tests/engine/test_qwen2_5_vl_vision.py tests/engine/test_images.py tests/engine/test_mrope.py -n 4 ;;
      vl-profile) python3 -m bench.profile_vision 2>&1 | tail -30 ;;
      vl-bench) python3 -m bench.images --model-config qwen2.5-vl-3b --num-images 1000 --image-size 448 --output-len 64 \
                --json "$OUT/vl-bench.json" 2>&1 | grep "^|\|Error" ;;
      fp8-kernels) tests tests/kernels/test_fp8_kv.py tests/kernels/test_fp8_quant.py tests/kernels/test_v_groups.py ;;
      fp8-one-split) python3 -m bench.fp8_decode --one-split --hq 32 2>&1 | grep "^|" ;;
      fp8-large) python3 -m bench.fp8_decode --large --hq 32 2>&1 | tail -24 ;;
      fp8-long) python3 -m bench.fp8_decode --long --hq 32 2>&1 | grep "^|" ;;
      fp8-splits) python3 -m bench.fp8_decode --splits --hq 16 2>&1 | tail -12 ;;
      fp8-accuracy) tests tests/engine/test_fp8_gpu.py -s
           grep "^|\|prompts," "$OUT/$s.log" ;;
      fp8-decode) python3 -m bench.fp8_decode --hq 16 2>&1 | tail -14 ;;
      fp8-decode-mix) python3 -m bench.fp8_decode --hq 16 --mix 2>&1 | tail -14 ;;
      w1-fp8) python3 -m bench --model-config qwen3-0.6b --num-prompts 256 --input-len 100:1024 --output-len 100:1024 \
                --engine-args '{"kv_cache_dtype": "fp8_e4m3"}' --json "$OUT/w1-fp8.json" 2>&1 | grep "^|" ;;
      w2-fp8) python3 -m bench --model-config llama-3.1-8b --num-prompts 1000 --input-len 1024 --output-len 256 \
                --engine-args '{"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}' --json "$OUT/w2-fp8.json" 2>&1 | grep "^|" ;;
      w2-fp8kv) python3 -m bench --model-config llama-3.1-8b --num-prompts 1000 --input-len 1024 --output-len 256 \
                --engine-args '{"kv_cache_dtype": "fp8_e4m3"}' --json "$OUT/w2-fp8kv.json" 2>&1 | grep "^|" ;;
      w1) bench $W1 ;;
      w1-peer) python3 -m bench --model-config qwen3-0.6b --num-prompts 256 --input-len 100:1024 --output-len 100:1024 --peer transformers --json "$OUT/w1-peer.json" 2>&1 | grep "^|" ;;
      w2) bench $W2 ;;
      prefix-off) bench $PREFIX --engine-args '{"disable_radix_cache": true}' ;;
      queue) python3 -m bench --model-config qwen3-0.6b --num-prompts 2000 --input-len 100:1024 --output-len 256 \
                --json "$OUT/queue.json" 2>&1 | grep "^|" ;;
      fewshot) for flag in false true; do python3 -m bench --model-config qwen3-0.6b --num-prompts 1000 --shared-prefix-len 2000 \
                --num-prefixes 8 --input-len 50 --output-len 64 \
                --engine-args "{\"disable_radix_cache\": $flag}" --json "$OUT/fewshot-$flag.json" 2>&1 | grep "^|"; done ;;
      prefix-plain) python3 -m bench --model-config qwen3-0.6b --num-prompts 1000 --shared-prefix-len 2000 --input-len 50 --output-len 64 \
                --engine-args '{"disable_shared_prefix_attention": true}' --json "$OUT/prefix-plain.json" 2>&1 | grep "^|" ;;
      prefix-profile) GRISTMILL_PROFILE=$OUT/prefix.prof python3 -m bench --model-config qwen3-0.6b --num-prompts 1000 --shared-prefix-len 2000 \
                --input-len 50 --output-len 64 2>&1 | grep "^|"
                  profile "$OUT/prefix.prof" ;;
      queue-profile) GRISTMILL_PROFILE=$OUT/queue.prof python3 -m bench --model-config qwen3-0.6b --num-prompts 2000 --input-len 100:1024 \
                --output-len 256 2>&1 | grep "^|"
                  profile "$OUT/queue.prof" ;;
      prefix-on) bench $PREFIX ;;
      fewshot-on) python3 -m bench --model-config qwen3-0.6b --num-prompts 1000 --shared-prefix-len 2000 --num-prefixes 8 \
                --input-len 50 --output-len 64 --json "$OUT/fewshot-on.json" 2>&1 | grep "^|" ;;
      prefix) for flag in false true; do python3 -m bench --model-config qwen3-0.6b --num-prompts 1000 --shared-prefix-len 2000 --input-len 50 --output-len 64 \
                --engine-args "{\"disable_radix_cache\": $flag}" --json "$OUT/prefix-$flag.json" 2>&1 | grep "^|"; done ;;
    esac
}
for step in "${@:-kernels engine w1 w2}"; do
  for s in $step; do run_step "$s"; done
done
if [ -n "${KEEP_TRITON_CACHE:-}" ]; then
  tar czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" . && echo "triton cache: $(du -h "$OUT/triton-cache.tgz" | cut -f1)"
fi
