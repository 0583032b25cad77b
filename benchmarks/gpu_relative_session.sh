#!/usr/bin/env bash
# One device call of at most 10 minutes that checks the fused kernels on CUDA and settles
# the route waiting on a measurement: the relative family's terms through the fused
# kernels (FUSED_RELATIVE_DEVICES).
#
#   bash benchmarks/gpu_relative_session.sh OUT
#
# 1. In parallel (at most 210 s): the fused kernels' CUDA tests under pytest-xdist, and
#    one untimed pass (--repeats 1, results thrown away) of every case of step 3, so
#    that Triton and inductor compile each kernel and autotuning candidate once, on
#    many cores, into their on-disk caches.
# 2. decode_profile: where one eager decode step of T5, ALiBi and RoPE spends its time.
# 3. fused_relative: the relative family on flex with and without the fused kernels,
#    against FlashAttention, from the warm caches, on a quiet GPU.
# 4. test_gpu: the rest of tests/test_gpu.py under pytest-xdist, in the time left.
set -uo pipefail
out="${1:?usage: gpu_relative_session.sh OUT}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
encodings=(bert_relative_key bert_relative_key_query deberta transformer_xl)
relative=(--device cuda --dtype bfloat16 --backends flex --lengths 2048 --compare-fused)
pytest=(python3 -m pytest -v -rf --tb=short --no-header -p no:cacheprovider -W ignore tests/test_gpu.py)
summary="PASSED|FAILED|ERROR|passed|failed|Error"

echo "== fused kernel tests and compiles (limit 210s)"
scratch=$(mktemp -d)
for name in "${encodings[@]}"; do
    for mode in forward train; do
        TORCHINDUCTOR_COMPILE_THREADS=1 timeout 210 python3 benchmarks/attention_backends.py \
            "${relative[@]}" --encodings "$name" --modes "$mode" --causal both --repeats 1 \
            --tag "_warm_${name}_$mode" --out "$scratch" >"$scratch/warm_${name}_$mode.log" 2>&1 &
    done
done
timeout -s INT -k 30 210 "${pytest[@]}" -n 6 -k "fused_distance_kernel or alibi_takes" 2>&1 |
    tee "$out/test_gpu_fused.log" | grep -E "$summary" | tail -25
wait
grep -h "failed" "$scratch"/warm_*.log | head -5

echo "== decode_profile (limit 60s)"
timeout 60 python3 benchmarks/decode.py --device cuda --dtype bfloat16 --encodings t5 alibi \
    rope --repeats 30 --profile --tag _profile --out "$scratch" 2>&1 |
    tee "$out/decode_profile.log" | grep -E "^ +(rope|alibi|t5) " || true

echo "== fused_relative (limit 170s)"
timeout 170 python3 benchmarks/attention_backends.py "${relative[@]}" \
    --encodings "${encodings[@]}" --modes forward train --causal both --repeats 10 \
    --tag _fused_relative --out "$out" 2>&1 | tee "$out/fused_relative.log" | tail -40

echo "== test_gpu (limit 110s)"
timeout -s INT -k 30 110 "${pytest[@]}" -n 14 -k "not fused_distance_kernel and not alibi_takes" 2>&1 |
    tee "$out/test_gpu.log" | grep -E "FAILED|ERROR|passed|failed" | tail -25
