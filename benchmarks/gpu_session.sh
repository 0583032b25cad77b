#!/usr/bin/env bash
# One batch of CUDA checks and benchmarks, sized for a lent GPU session (each step has
# its own time limit, so a slow step cannot eat the rest). Run from the repository root
# on a machine with CUDA, torch and triton:
#
#   bash benchmarks/gpu_session.sh [OUT [STEP ...]]   # OUT: where logs and results go
#
# The steps' limits add up to more than one device call may run (10 minutes) and than
# a session's device time (15 to 30 minutes): name the steps each call should run, e.g.
#   bash benchmarks/gpu_session.sh "$OUT" test_gpu_relative
#   bash benchmarks/gpu_session.sh "$OUT" fused_relative
#   bash benchmarks/gpu_session.sh "$OUT" test_gpu_fused
#   bash benchmarks/gpu_session.sh "$OUT" fused_kernel fused
#   bash benchmarks/gpu_session.sh "$OUT" test_gpu
# (no STEP: all of them, in order). A session of 15 minutes (machine start included)
# fits one call of about 9 minutes. benchmarks/gpu_relative_session.sh ran on
# 2026-12-04: it runs the compile-heavy tests under pytest-xdist while other processes
# fill Triton's and inductor's on-disk caches, then times from the warm caches;
# benchmarks/gpu_decode_session.sh ran on 2026-12-06 (the whole of test_gpu.py, the
# static-cache and growing decode steps). What waits next, in this order:
#   bash benchmarks/gpu_session.sh "$OUT" test_gpu_fixed
# (the cases that run failed, fixed since: TUPE-A's wide flex tiles, the window test's
# positions, the sync count; and DeBERTa's float32 relative-term case, unreported: if it
# passes, list "cuda" in FUSED_RELATIVE_DEVICES for forwards, 1.1-1.4x faster than the
# score_mod), then
#   bash benchmarks/gpu_session.sh "$OUT" hf_decode_static decode_tupe decode family_strided
# (a Llama's compiled static-cache decode through posgen.hf against HF's own attention,
# TUPE's step with its untied term folded or added as a bias, compiled steps with a
# profile, and the clipped terms at given positions), then
#   bash benchmarks/gpu_session.sh "$OUT" rotation_launch rotary
# (the rotary kernel's launch shapes against a copy, host work apart: set the fastest
# as the defaults in templates/runtime/_rotation_kernel.py, then time rotary.py), then
#   bash benchmarks/gpu_session.sh "$OUT" compile_sweep compile_sweep_grad
# (every module compiled by inductor on CUDA, as benchmarks/compile_sweep.py did on the
# CPU on 2026-12-06). The test steps stop with SIGINT
# at their limit, so pytest still prints its failure summary (-rf).
#
# posgen's runtime needs only torch; the tests also import pydantic, jinja2, pyyaml,
# click and hypothesis, and the peers (transformers, x-transformers, Liger-Kernel,
# rotary-embedding-torch) are optional; an image without pydantic (the lent H100s and
# H200s: pydantic, pydantic-core, annotated-types, typing-inspection) needs their wheels
# installed first, e.g. pip install --no-index --target DIR wheels/*.whl and DIR put on
# PYTHONPATH (this script keeps a PYTHONPATH it is given). Results land in OUT (default
# benchmarks/results), to be committed with the machine they name.
set -uo pipefail
out="${1:-benchmarks/results}"
shift || true
wanted=" $* "  # the steps to run; all where none is named
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS="${TORCHINDUCTOR_COMPILE_THREADS:-16}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
step() {  # step SECONDS NAME COMMAND...: run with a limit, log to OUT/NAME.log
    local limit="$1" name="$2"
    shift 2
    if [[ "$wanted" != "  " && "$wanted" != *" $name "* ]]; then
        return 0
    fi
    echo "== $name (limit ${limit}s)"
    timeout -s INT -k 30 "$limit" "$@" 2>&1 | tee "$out/$name.log" | tail -25
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# the fused kernel's cases compile a kernel per tile, bias form, band and dtype (about a
# minute a case on an H200), so they have their own step; the compiles are CPU work, so
# the test steps spread their cases over pytest-xdist workers (16 cores there)
step 540 test_gpu_fused python3 -m pytest -v -rf --tb=short --no-header -p no:cacheprovider -W ignore \
    -n 6 tests/test_gpu.py -k "fused_distance_kernel and not relative_terms"
# the kernels with relative terms (forward and training step; two encodings x two
# dtypes x two masks)
step 420 test_gpu_relative python3 -m pytest -v -rf --tb=short --no-header -p no:cacheprovider -W ignore \
    -n 8 tests/test_gpu.py -k "fused_distance_kernel and relative_terms"
step 300 test_gpu_fixed python3 -m pytest -v -rf --tb=short --no-header -p no:cacheprovider \
    -W ignore -n 12 tests/test_gpu.py -k "windows_and_documents or inductor_fullgraph or \
    decode_loop_syncs or relative_terms or auto_picks"
step 480 test_gpu python3 -m pytest -v -rf --tb=short --no-header -p no:cacheprovider -W ignore \
    -n 14 tests/test_gpu.py -k "not fused_distance_kernel"
step 150 rotary python3 benchmarks/rotary.py --device cuda --dtype bfloat16 --compile \
    --shapes 4,32,4096,128 --repeats 30 --out "$out"
step 150 rotary_backward python3 benchmarks/rotary.py --device cuda --dtype bfloat16 \
    --compile --backward --shapes 4,32,4096,128 --repeats 20 --out "$out"
step 120 rotary_float32 python3 benchmarks/rotary.py --device cuda --dtype float32 --compile \
    --shapes 4,32,4096,128 --repeats 30 --out "$out"
# the fused rotation's launch shape (positions and heads per program, warps): the
# module's call and the kernel alone at the default shape, then the kernel at each
# shape of the sweep, Liger-Kernel's one-position-per-program among them
step 240 rotation_launch python3 benchmarks/rotation_launch.py --device cuda --dtype bfloat16 \
    --shape 4,32,4096,128 --repeats 30 --out "$out"
step 300 attention python3 benchmarks/attention_backends.py --device cuda --dtype bfloat16 \
    --encodings alibi t5 kerple_log --backends sdpa flex --lengths 2048 8192 \
    --modes forward train --causal both --hf --repeats 15 --tag _bias --out "$out"
step 400 fused python3 benchmarks/attention_backends.py --device cuda --dtype bfloat16 \
    --encodings alibi alibi_learned t5 --backends sdpa flex --lengths 2048 8192 --modes forward train \
    --causal both --compare-fused --repeats 10 --tag _fused --out "$out"
step 180 fused_kernel python3 benchmarks/fused_distance.py --kinds none clipped gathered \
    vector --modes forward --repeats 10 --out "$out"
step 200 family python3 benchmarks/attention_backends.py --device cuda --dtype bfloat16 \
    --encodings bert_relative_key deberta transformer_xl fire --backends sdpa flex \
    --lengths 2048 --modes forward train --causal no --repeats 10 --tag _family --out "$out"
# positions given two apart (no shift of the defaults): BERT's and DeBERTa's clipped
# terms read per score at clip(j - i) from their projections over every table row
# (_clipped_relative_parts), where they were captured as [B, H, N, M] tensors before
step 200 family_strided python3 benchmarks/attention_backends.py --device cuda \
    --dtype bfloat16 --encodings bert_relative_key_query deberta --backends sdpa flex \
    --lengths 2048 --modes forward train --causal no --given-positions --position-stride 2 \
    --repeats 10 --tag _family_strided --out "$out"
# packed documents (8 of N / 8 tokens, positions restarting at each): flex with the
# per-distance vector (the positions recognised as the defaults shifted per document)
# against the positions kept as given (a bias per pair)
step 300 documents python3 benchmarks/attention_backends.py --device cuda --dtype bfloat16 \
    --encodings alibi t5 kerple_log --backends flex --lengths 2048 8192 --modes forward train \
    --causal yes --documents 8 --restart-positions --compare-shifted --repeats 10 \
    --tag _documents --out "$out"
# the relative family with its terms read from their projections in the fused kernels
# (FUSED_RELATIVE_DEVICES, FUSED_RELATIVE_TRAINED_DEVICES) against FlexAttention's
# score_mod, the measurement the route waits for; test_gpu_relative checks the kernels'
# relative terms first
step 540 fused_relative python3 benchmarks/attention_backends.py --device cuda \
    --dtype bfloat16 --encodings bert_relative_key bert_relative_key_query deberta \
    transformer_xl --backends flex --lengths 2048 --modes forward train --causal both \
    --compare-fused --repeats 10 --tag _fused_relative --out "$out"
# the grouped-query decode matmuls on CUDA against the eager oracle (a few seconds),
# then one eager decode step with and without them (no compile: a minute or two)
step 120 test_gpu_grouped python3 -m pytest -v -rf --tb=short --no-header -p no:cacheprovider -W ignore \
    tests/test_gpu.py -k grouped_query
step 180 decode_grouped python3 benchmarks/decode.py --device cuda --dtype bfloat16 \
    --compare-grouped --repeats 100 --tag _grouped --out "$out"
# one decode step, eager and compiled as a CUDA graph (an eager step was host-bound on
# the H200: RoPE 39 us of device time in a 145-301 us step), with a profile of each
step 240 decode python3 benchmarks/decode.py --device cuda --dtype bfloat16 --compile \
    --compile-mode reduce-overhead --profile --out "$out"
# a decoding loop's step under CUDA graphs over a preallocated cache (8000 of 8192 slots
# filled, the query's position a tensor, the empty slots masked), beside plain SDPA
# compiled the same way: the form the <= 1.3x decode target waits on
step 300 decode_static python3 benchmarks/decode.py --device cuda --dtype bfloat16 \
    --encodings rope rope_gptj alibi t5 kerple_log --cache 8000 --static-slots 8192 \
    --compile-mode reduce-overhead --repeats 100 --tag _static_cache --out "$out"
# the eager step with a new key count every call (8129 to 8192 keys), as a decoding loop
# runs it: per-shape work (tables, masks) is redone where a fixed M hid it; the
# encodings with kept projections also inside a parameters_frozen block (no sync for
# the comparison of the parameters), and each called causal, as a causal model calls it
# (one query at the newest position: the sdpa backend drops that mask, which masks
# nothing)
step 200 decode_growing python3 benchmarks/decode.py --device cuda --dtype bfloat16 \
    --encodings rope alibi t5 kerple_log deberta transformer_xl tupe_a --growing 64 \
    --compare-frozen --compare-causal --repeats 128 --tag _growing --out "$out"
# TUPE's decode step (its table stops at 512 positions, so 500 cached keys), its
# untied term folded into q and k (CUDA's default: the key cache copied with the
# position features every step) against added as a bias, inside and outside a
# parameters_frozen block
step 120 decode_tupe python3 benchmarks/decode.py --device cuda --dtype bfloat16 \
    --encodings tupe_a tupe_r --cache 500 --growing 64 --compare-fold --compare-frozen \
    --repeats 128 --tag _tupe --out "$out"
# a whole Llama's decode steps through posgen.hf against its own attention, as a user's
# fast decoding loop runs them: a StaticCache, model.forward compiled with fullgraph and
# replayed as CUDA graphs (the transformers of the image; 4 layers, 32 heads on 8)
step 300 hf_decode_static python3 benchmarks/hf_decode.py --device cuda --dtype bfloat16 \
    --cache static --compile --compile-mode reduce-overhead --prompts 512 4096 --layers 4 \
    --heads 32 --kv-heads 8 --head-dim 128 --batch 4 --steps 64 --repeats 9 \
    --tag _static_compiled --out "$out"
# relative-table decode steps with and without the few-query path and kept rows, and
# the relative family's terms gathered per chunk from their projections against the
# dense terms (sdpa; flex in the same run)
step 200 decode_relative python3 benchmarks/decode.py --device cuda --dtype bfloat16 \
    --encodings bert_relative_key_query deberta transformer_xl --compare-dense \
    --batch 4 --heads 16 --kv-heads 16 --head-dim 64 --cache 8192 --tag _relative --out "$out"
step 300 relative_parts python3 benchmarks/attention_backends.py --device cuda \
    --dtype bfloat16 --encodings bert_relative_key_query deberta transformer_xl \
    --backends sdpa flex --lengths 2048 --modes forward train --causal both --compare-parts \
    --repeats 10 --tag _relative_parts --out "$out"
step 200 relative_layers python3 benchmarks/relative_layers.py --device cuda \
    --dtype bfloat16 --modes forward train --lengths 512 2048 --out "$out"
# every module compiled whole by inductor on both backends at every kind of position,
# forward, then a training step (the CPU's sweep is in benchmarks/results); the log
# keeps each line if a step meets its limit before the table is written
step 540 compile_sweep python3 benchmarks/compile_sweep.py --device cuda --out "$out"
step 540 compile_sweep_grad python3 benchmarks/compile_sweep.py --device cuda --grad \
    --out "$out"
