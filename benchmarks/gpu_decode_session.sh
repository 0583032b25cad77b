#!/usr/bin/env bash
# One device call of at most 10 minutes: the whole of tests/test_gpu.py on CUDA, then the
# decode target's form (a decoding loop's step replayed as a CUDA graph over a
# preallocated cache) and the eager step with a new key count each call.
#
#   bash benchmarks/gpu_decode_session.sh OUT
#
# 1. In parallel (at most 290 s): tests/test_gpu.py under pytest-xdist, and one untimed
#    pass (--repeats 1, results thrown away) of each encoding's static-cache step, so
#    that inductor and Triton compile its kernels once, on spare cores, into their
#    on-disk caches.
# 2. decode_static (at most 150 s): the static-cache steps timed from the warm caches,
#    beside plain SDPA compiled the same way.
# 3. decode_growing (at most 90 s): eager steps of 8129 to 8192 keys, each module also
#    called causal, as a causal model calls it.
set -uo pipefail
out="${1:?usage: gpu_decode_session.sh OUT}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_COMPILE_THREADS=1  # the processes of step 1 share 16 cores
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
encodings=(rope rope_gptj alibi t5 kerple_log)
static=(--device cuda --dtype bfloat16 --cache 8000 --static-slots 8192
    --compile-mode reduce-overhead)

echo "== test_gpu and the static-cache compiles (limit 290s)"
scratch=$(mktemp -d)
for name in "${encodings[@]}"; do
    timeout 280 python3 benchmarks/decode.py "${static[@]}" --encodings "$name" --repeats 1 \
        --tag "_warm_$name" --out "$scratch" >"$scratch/warm_$name.log" 2>&1 &
done
timeout -s INT -k 20 290 python3 -m pytest -v -rf --tb=short --no-header -p no:cacheprovider \
    -W ignore -n 11 tests/test_gpu.py 2>&1 | tee "$out/test_gpu.log" |
    grep -E "^(FAILED|ERROR)|passed|failed" | tail -40
wait
grep -h -E "Error|error" "$scratch"/warm_*.log | head -5

echo "== decode_static (limit 150s)"
timeout 150 python3 benchmarks/decode.py "${static[@]}" --encodings "${encodings[@]}" \
    --repeats 100 --tag _static_cache --out "$out" 2>&1 | tee "$out/decode_static.log" | tail -16

echo "== decode_growing (limit 90s)"
timeout 90 python3 benchmarks/decode.py --device cuda --dtype bfloat16 --encodings rope alibi \
    t5 --growing 64 --compare-causal --repeats 128 --tag _growing --out "$out" 2>&1 |
    tee "$out/decode_growing.log" | tail -14
