"""Attention speed and memory of each generated module's backends, against plain SDPA.

For every encoding, sequence length, causal setting and mode (forward alone, or a
training step: forward and backward into q, k, v and the module's parameters), times
each backend beside plain ``F.scaled_dot_product_attention`` with no position encoding
(FlashAttention on a CUDA GPU in half precision: the baseline), the two timed
alternately in the same loop. Also times compiled FlexAttention with no ``score_mod``
("flex, no bias": the floor of any score_mod) and, where transformers is installed,
Hugging Face's T5 bias path (``T5Attention.compute_bias`` plus its attention
arithmetic). Reports ratios to the baseline and peak extra memory (on CUDA from the
allocator's statistics, on the CPU from the profiler's allocation records).

``--compare-clipped`` also times, for a trained bias clipped at a distance (T5), the
sdpa backend with its clipped-bias training path turned off (the query-chunked path it
replaced) and the flex backend with its clipped-bias route turned on (the bias read per
score as a constant, its gradient from a band and two triangles), in the same loop; for
relative terms clipped at a distance (Shaw, BERT relative_key, DeBERTa), the sdpa
backend with its clipped-relative path (``clipped_relative_attention``) turned off.

``--compare-fused`` also times, for a bias of j - i alone (ALiBi, T5, KERPLE ...), the
flex backend with its fused Triton route taken for every bias form and for none
(``FUSED_DISTANCE_ROUTES``: ALiBi's bias computed per score, other biases read from
their per-distance vector, T5's table trained through the attached band-and-triangle
gradient; FlexAttention's score_mod otherwise), in the same loop; with a training mode
and a bias that trains, also the route with its gradient summed in the kernel
(``FUSED_DISTANCE_TRAINED_DEVICES``).

For relative terms read from their projections (BERT, DeBERTa, Transformer-XL) it
times the flex backend with and without the kernels that read them per score
(``FUSED_RELATIVE_DEVICES``, ``FUSED_RELATIVE_TRAINED_DEVICES``).

``--compare-distance-vector`` also times, at explicit positions, each bias of j - i that
is made once per distance the pairs reach and read per pair (KERPLE, Sandwich, an
expression of j - i) on the sdpa backend with that vector off (``DISTANCE_VECTOR_DEVICES``
emptied in the module's runtime: the bias per pair), in the same loop.

``--compare-floor`` also times position biases on the sdpa backend without the floor
under their entries far below each row's top (``BIAS_FLOOR_DEVICES``).

``--compare-chunked`` also times training steps on the sdpa backend with one SDPA call
per query chunk (``CHUNKED_FLASH_DEVICES`` emptied: no ``chunked_flash_attention``),
its q, k and v slices taken as one autograd node (``sequence_slices``) and, as before
either, each sliced through autograd on its own.

``--compare-recomputed`` also times training steps on the sdpa backend whose chunk
masks train (FIRE, TUPE-R) with one call per query chunk through autograd
(``RECOMPUTED_MASK_DEVICES`` emptied: no ``recomputed_mask_attention``), in the same
loop.

``--compare-directional`` also times training steps on the sdpa backend of a bias of
j - i with trained scalars per head (KERPLE, trained ALiBi slopes) without its path that
gets their gradients from one flash forward each (``DIRECTIONAL_BIAS_DEVICES`` emptied:
no ``directional_bias_attention``; the query chunks' trained masks instead), in the
same loop.

``--compare-parts`` also times, for relative terms (BERT, DeBERTa, Transformer-XL ...),
the sdpa backend without its route that gathers each query chunk's terms from their
projections over the table rows (``_sdpa_relative_parts``): the dense terms, built per
chunk at the chunk's positions under causal masking, in the same loop.

``--given-positions`` passes the default positions explicitly to every module call
(``q_positions`` and ``k_positions`` 0 .. N - 1, as Hugging Face-style position ids
are); the baseline is unchanged.

``--position-offset K`` passes ``q_positions`` and ``k_positions`` K .. K + N - 1:
explicit positions that are not the defaults (for K >= 1), with the defaults' relative
positions. An encoding with ``shift_invariant`` (one that reads positions only as key
minus query) treats them as the defaults; any other builds its bias per pair.
``--compare-shifted`` also times such an encoding with that recognition off (the
instance's ``shift_invariant`` False: the per-pair paths), in the same loop; so it does
for positions that restart per document (``--restart-positions``).

``--specs FILE ...`` times spec files beside the catalogue's encodings, each built in
memory (as ``posgen check`` builds it), under its spec's name.
``--compare-by-distance`` also times each bias of j - i (``bias_by_distance``) on the
sdpa backend with its per-distance paths off (the instance's flags: the bias per pair,
in chunks, as for a bias of positions), in the same loop.

``--documents D`` packs D documents of equal length into each sequence: every module
call gets ``document_ids`` (and, with ``--restart-positions``, positions that restart at
each document), and the baseline is SDPA with the equivalent boolean mask.
``--compare-documents`` also times the sdpa backend with each chunk of queries over
every key its causal mask or window allows, not only its documents' keys (no
``document_spans``; without a position term, one SDPA call where such chunks would hold
more than ``DOCUMENT_CHUNKS_MAX_COVER`` of the pairs), and, without a position term,
as one SDPA call with the documents' mask, in the same loop; with relative terms, as
one call over every query and key (``sdpa, terms in one call``: how terms at explicit
positions with documents were built before they went a query chunk at a time).
``--position-stride S`` spaces the positions S apart (with ``--given-positions``,
``--position-offset`` or ``--restart-positions``): explicit positions that are not a
shift of the defaults.

``--window W`` adds a sliding window (query - W < key <= query when causal, |query - key|
< W otherwise) to every candidate (``forward(..., window=W)``; plain flex with the same
block mask); the baseline is then SDPA with the equivalent boolean [N, N] mask, built
once outside the timing.

    python benchmarks/attention_backends.py --device cuda --dtype bfloat16 \
        --backends sdpa flex --lengths 2048 8192 --modes forward train --causal both
    python benchmarks/attention_backends.py --device cpu --lengths 512 2048
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_memory import cpu_peak_extra_bytes  # noqa: E402

import generated._chunked_flash as chunked_flash  # noqa: E402
import generated._clipped_relative as clipped_relative  # noqa: E402
import generated._directional_bias as directional_bias  # noqa: E402
import generated._distances as distances  # noqa: E402
import generated._flex as flex_runtime  # noqa: E402
import generated._flex_backend as flex_backend  # noqa: E402
import generated._masks as masks  # noqa: E402
import generated._numerics as numerics  # noqa: E402
import generated._recomputed_mask as recomputed_mask  # noqa: E402
import generated._sdpa_chunks as sdpa_chunks  # noqa: E402
import generated._sdpa_relative as sdpa_relative  # noqa: E402
import generated._trained_bias as trained_bias  # noqa: E402
from generated import ENCODINGS  # noqa: E402
from posgen.codegen.inmemory import encoding_class, module_from_spec  # noqa: E402

DEFAULT_ENCODINGS = [
    "alibi",
    "t5",
    "rope",
    "rope_gptj",
    "sinusoidal",
    "shaw",
    "bert_relative_key",
    "deberta",
    "transformer_xl",
    "tupe_r",
]

Call = Callable[[], object]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def paired_seconds(
    fn: Call, baseline: Call, device: torch.device, repeats: int
) -> tuple[float, float]:
    """Median times of ``fn`` and ``baseline``, timed alternately after warm-up.

    Alternating the two calls exposes both to the same drift in machine load, so their
    ratio is steadier than two separate medians. On CUDA each call is timed with CUDA
    events (device time, no host launch gap); on the CPU with the host clock.
    """
    seconds, base = interleaved_seconds([fn, baseline], device, repeats)
    return seconds, base


def interleaved_seconds(calls: list[Call], device: torch.device, repeats: int) -> list[float]:
    """Median times of ``calls``, taking turns in every repeat after warm-up (see
    ``paired_seconds``)."""
    for _ in range(3):
        for call in calls:
            call()
    _sync(device)
    times: dict[int, list[float]] = {index: [] for index in range(len(calls))}
    for _ in range(repeats):
        for index, call in enumerate(calls):
            if device.type == "cuda":
                start_event = torch.cuda.Event(enable_timing=True)
                end_event = torch.cuda.Event(enable_timing=True)
                start_event.record()
                call()
                end_event.record()
                end_event.synchronize()
                times[index].append(start_event.elapsed_time(end_event) / 1e3)
            else:
                start = time.perf_counter()
                call()
                times[index].append(time.perf_counter() - start)
    return [statistics.median(times[index]) for index in range(len(calls))]


def peak_extra_bytes(fn: Call, device: torch.device) -> int | None:
    """Peak memory a call allocates beyond what was allocated before it: CUDA's
    allocator statistics, or on the CPU the profiler's allocation records
    (``cpu_memory.cpu_peak_extra_bytes``, a separate untimed call)."""
    if device.type == "cpu":
        return cpu_peak_extra_bytes(fn)
    if device.type != "cuda":
        return None
    _sync(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - base


def as_step(attend: Callable[[], torch.Tensor], inputs: list[torch.Tensor], mode: str) -> Call:
    """``attend`` as a forward pass (no autograd) or a training step (forward, then the
    gradients of a fixed random cotangent into ``inputs``, those it reaches)."""
    if mode == "forward":

        def forward() -> object:
            with torch.no_grad():
                return attend()

        return forward
    cotangent: list[torch.Tensor] = []

    def train() -> object:
        out = attend()
        if not cotangent:
            cotangent.append(torch.randn_like(out))
        return torch.autograd.grad(out, inputs, cotangent[0], allow_unused=True)

    return train


def window_allowed(
    n: int,
    causal: bool,
    window: int | None,
    device: torch.device,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """bool [n, n], True where query i may attend key j at default positions: j <= i when
    causal, |i - j| < window when a window is given, both in one document when
    ``document_ids`` [n] are given."""
    distance = torch.arange(n, device=device)[:, None] - torch.arange(n, device=device)
    allowed = torch.ones(n, n, dtype=torch.bool, device=device)
    if causal:
        allowed &= distance >= 0
    if window is not None:
        allowed &= distance.abs() < window
    if document_ids is not None:
        allowed &= document_ids[:, None] == document_ids
    return allowed


def packed_documents(n: int, count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` documents of equal length in n tokens: their ids [n] and the positions
    [n] that restart at each document."""
    ids = torch.arange(n, device=device) * count // n
    starts = torch.searchsorted(ids, ids)  # each token's document's first token
    return ids, torch.arange(n, device=device) - starts


@contextlib.contextmanager
def document_chunks_off() -> Iterator[None]:
    """The sdpa backend with packed documents and no position term as one SDPA call
    with the documents' mask, however few pairs its chunks would hold
    (``DOCUMENT_CHUNKS_MAX_COVER``)."""
    cover = masks.DOCUMENT_CHUNKS_MAX_COVER
    masks.DOCUMENT_CHUNKS_MAX_COVER = -1.0
    try:
        yield
    finally:
        masks.DOCUMENT_CHUNKS_MAX_COVER = cover


@contextlib.contextmanager
def document_spans_off() -> Iterator[None]:
    """The sdpa backend with each query chunk over every key its causal mask or window
    allows, not narrowed to its documents' keys (``document_spans``)."""
    narrow = masks.document_spans
    masks.document_spans = lambda spans, *_: spans
    try:
        yield
    finally:
        masks.document_spans = narrow


@contextlib.contextmanager
def relative_chunks_off() -> Iterator[None]:
    """The sdpa backend's relative terms in one call over every query and key (no
    ``reachable_query_chunks`` in ``_sdpa_relative``): how terms at explicit positions
    with packed documents were built before they went a query chunk at a time."""
    chunks = sdpa_relative.reachable_query_chunks
    sdpa_relative.reachable_query_chunks = lambda n, m, *_, **__: [(0, n, 0, m)]
    try:
        yield
    finally:
        sdpa_relative.reachable_query_chunks = chunks


def plain_flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int | None
) -> Callable[[], torch.Tensor]:
    """Compiled FlexAttention with no score_mod (and a causal and/or window block mask)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    n = q.shape[2]
    mask = None
    if causal or window is not None:

        def mask_mod(
            b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor
        ) -> torch.Tensor:
            distance = qi - ki
            if window is None:
                return distance >= 0  # causal alone
            near = (distance < window) & (distance > -window)
            return near & (distance >= 0) if causal else near

        mask = create_block_mask(mask_mod, None, None, n, n, device=str(q.device))
    return lambda: compiled(q, k, v, block_mask=mask)


def hf_t5_bias_path(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int | None
) -> tuple[Callable[[], torch.Tensor], list[torch.Tensor]] | None:
    """Hugging Face's T5 attention arithmetic: ``compute_bias`` (an embedding lookup of
    [N, M] buckets), q kᵀ + bias (+ a causal mask), softmax in float32, times v."""
    try:
        from transformers import T5Config
        from transformers.models.t5.modeling_t5 import T5Attention
    except ImportError:
        return None
    heads, head_dim = q.shape[1], q.shape[3]
    config = T5Config(d_model=heads * head_dim, d_kv=head_dim, num_heads=heads, is_decoder=causal)
    layer = T5Attention(config, has_relative_attention_bias=True, layer_idx=0)
    layer = layer.to(q.device, q.dtype)
    n = q.shape[2]
    mask = None
    if causal or window is not None:
        allowed = window_allowed(n, causal, window, q.device)
        mask = torch.zeros((n, n), device=q.device, dtype=q.dtype).masked_fill(
            ~allowed, float("-inf")
        )

    def attend() -> torch.Tensor:
        bias = layer.compute_bias(n, n, device=q.device)  # [1, H, N, M]
        if mask is not None:
            bias = bias + mask
        scores = torch.matmul(q, k.transpose(3, 2)) + bias
        weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        return torch.matmul(weights, v)

    return attend, [layer.relative_attention_bias.weight]


@contextlib.contextmanager
def runtime_setting(backend: str, setting: object, device: torch.device) -> Iterator[None]:
    """The runtime with one swept setting in place: flex's kernel options (a dict, {} for
    FlexAttention's defaults) or sdpa's queries per call on ``device`` ("none": one call;
    long sequences then get no longer chunks, ``SDPA_LONG_QUERY_CHUNK``); None leaves
    the runtime as it is; ("mask", MiB): the bytes a chunk's own mask may take
    (``SDPA_MASK_CHUNK_BYTES``, "none": no cap)."""
    if setting is None:
        yield
    elif isinstance(setting, tuple):
        budgets = masks.SDPA_MASK_CHUNK_BYTES
        before_budget = budgets.pop(device.type, None)
        if setting[1] != "none":
            budgets[device.type] = int(float(setting[1]) * (1 << 20))
        try:
            yield
        finally:
            budgets.pop(device.type, None)
            if before_budget is not None:
                budgets[device.type] = before_budget
    elif backend == "flex":
        chosen = flex_runtime.flex_kernel_options
        flex_runtime.flex_kernel_options = lambda q, has_score_mod: setting or None
        try:
            yield
        finally:
            flex_runtime.flex_kernel_options = chosen
    else:
        chunks, long_chunks = masks.SDPA_QUERY_CHUNK, masks.SDPA_LONG_QUERY_CHUNK
        before, long_before = chunks.get(device.type), long_chunks.pop(device.type, None)
        chunks[device.type] = None if setting == "none" else int(str(setting))
        try:
            yield
        finally:
            chunks[device.type] = before
            if long_before is not None:
                long_chunks[device.type] = long_before


@contextlib.contextmanager
def clipped_path_off() -> Iterator[None]:
    """The runtime without its clipped-bias training path (``clipped_bias_attention``,
    for a bias clipped at a distance) and its clipped-relative path
    (``clipped_relative_attention``): a trained bias takes the query-chunked path,
    relative terms the dense one."""
    least_bias = trained_bias.CLIPPED_BIAS_MIN_KEYS_PER_CLIP
    least_relative = clipped_relative.CLIPPED_RELATIVE_MIN_KEYS_PER_CLIP
    trained_bias.CLIPPED_BIAS_MIN_KEYS_PER_CLIP = 2**62
    clipped_relative.CLIPPED_RELATIVE_MIN_KEYS_PER_CLIP = {False: 2**62, True: 2**62}
    try:
        yield
    finally:
        trained_bias.CLIPPED_BIAS_MIN_KEYS_PER_CLIP = least_bias
        clipped_relative.CLIPPED_RELATIVE_MIN_KEYS_PER_CLIP = least_relative


@contextlib.contextmanager
def parts_route_off() -> Iterator[None]:
    """The sdpa backend without ``_sdpa_relative_parts``: relative terms built densely
    (per query chunk at its positions when causal or windowed)."""
    serve = sdpa_relative.relative_parts_serve
    sdpa_relative.relative_parts_serve = lambda factors, causal: False
    try:
        yield
    finally:
        sdpa_relative.relative_parts_serve = serve


@contextlib.contextmanager
def device_set(module: ModuleType, name: str, device: torch.device, on: bool) -> Iterator[None]:
    """The runtime with ``device`` added to (``on``) or taken from the device set
    ``module.name`` that switches one of its paths (``BIAS_FLOOR_DEVICES``,
    ``RECOMPUTED_MASK_DEVICES``, ``DIRECTIONAL_BIAS_DEVICES``,
    ``CLIPPED_BIAS_FLEX_DEVICES``, ...)."""
    devices = getattr(module, name)
    setattr(module, name, devices | {device.type} if on else devices - {device.type})
    try:
        yield
    finally:
        setattr(module, name, devices)


def distance_vector_off(
    pe: torch.nn.Module, device: torch.device
) -> contextlib.AbstractContextManager[None]:
    """The sdpa backend computing ``pe``'s bias of j - i per pair at explicit positions on
    ``device``, not once per distance (``DISTANCE_VECTOR_DEVICES``), in its runtime: the
    module's own for a spec built in memory (the runtime inlined), else generated/'s."""
    module = sys.modules[type(pe).__module__]
    runtime = module if "DISTANCE_VECTOR_DEVICES" in vars(module) else distances
    return device_set(runtime, "DISTANCE_VECTOR_DEVICES", device, on=False)


def bias_floor_off(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """The sdpa backend giving SDPA its bias as it is on ``device``: no floor under the
    entries far below each row's top (``BIAS_FLOOR_DEVICES``)."""
    return device_set(distances, "BIAS_FLOOR_DEVICES", device, on=False)


@contextlib.contextmanager
def chunked_flash_off(device: torch.device, plain_slices: bool) -> Iterator[None]:
    """The sdpa backend's chunked training steps on ``device`` as one SDPA call per
    chunk, without ``chunked_flash_attention`` (``CHUNKED_FLASH_DEVICES``), and with
    ``plain_slices`` each chunk's q, k and v sliced through autograd on its own (no
    ``sequence_slices``)."""
    devices, slices = chunked_flash.CHUNKED_FLASH_DEVICES, sdpa_chunks.sequence_slices
    chunked_flash.CHUNKED_FLASH_DEVICES = devices - {device.type}
    if plain_slices:
        sdpa_chunks.sequence_slices = lambda x, ranges: tuple(x[:, :, a:b] for a, b in ranges)
    try:
        yield
    finally:
        chunked_flash.CHUNKED_FLASH_DEVICES = devices
        sdpa_chunks.sequence_slices = slices


def recomputed_mask_off(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """The sdpa backend's chunked training steps whose masks train on ``device`` as one
    call per chunk through autograd, without ``recomputed_mask_attention``
    (``RECOMPUTED_MASK_DEVICES``)."""
    return device_set(recomputed_mask, "RECOMPUTED_MASK_DEVICES", device, on=False)


def directional_path_off(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """The sdpa backend's training steps of a per-distance bias with trained scalars
    per head on ``device`` without ``directional_bias_attention``
    (``DIRECTIONAL_BIAS_DEVICES``)."""
    return device_set(directional_bias, "DIRECTIONAL_BIAS_DEVICES", device, on=False)


@contextlib.contextmanager
def instance_flags(pe: torch.nn.Module, **flags: object) -> Iterator[None]:
    """``pe`` with its class's composition flags ``flags`` overridden on the instance."""
    for flag, value in flags.items():
        setattr(pe, flag, value)
    try:
        yield
    finally:
        for flag in flags:
            delattr(pe, flag)  # the class's flags again


def shift_recognition_off(pe: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    """``pe`` keeping positions that are the defaults plus a constant as given (its
    ``shift_invariant`` False), so that they take the per-pair paths."""
    return instance_flags(pe, shift_invariant=False)


def clipped_flex_route_on(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """The runtime with flex training a clipped bias through a constant per-score read
    and the attached band-and-triangle gradient on ``device``
    (``CLIPPED_BIAS_FLEX_DEVICES``)."""
    return device_set(flex_backend, "CLIPPED_BIAS_FLEX_DEVICES", device, on=True)


@contextlib.contextmanager
def fused_route(device: torch.device, on: bool, trained: bool = False) -> Iterator[None]:
    """The runtime with flex's fused route (a bias of j - i through the Triton kernel,
    ``FUSED_DISTANCE_ROUTES``) taken on ``device`` for every bias form, or for none;
    ``trained``: a bias that trains too, its gradient summed in the kernel
    (``FUSED_DISTANCE_TRAINED_DEVICES``). Relative terms read from their projections
    take the kernels likewise (``FUSED_RELATIVE_DEVICES`` and
    ``FUSED_RELATIVE_TRAINED_DEVICES``)."""
    routes = flex_backend.FUSED_DISTANCE_ROUTES
    trained_devices = flex_backend.FUSED_DISTANCE_TRAINED_DEVICES
    relative_devices = flex_backend.FUSED_RELATIVE_DEVICES
    relative_trained = flex_backend.FUSED_RELATIVE_TRAINED_DEVICES
    flex_backend.FUSED_DISTANCE_ROUTES = {
        form: (devices | {device.type}) if on else devices - {device.type}
        for form, devices in routes.items()
    }
    flex_backend.FUSED_RELATIVE_DEVICES = (
        relative_devices | {device.type} if on else relative_devices - {device.type}
    )
    flex_backend.FUSED_RELATIVE_TRAINED_DEVICES = (
        relative_trained | {device.type} if on else relative_trained - {device.type}
    )
    if trained:
        flex_backend.FUSED_DISTANCE_TRAINED_DEVICES = trained_devices | {device.type}
    try:
        yield
    finally:
        flex_backend.FUSED_DISTANCE_ROUTES = routes
        flex_backend.FUSED_DISTANCE_TRAINED_DEVICES = trained_devices
        flex_backend.FUSED_RELATIVE_DEVICES = relative_devices
        flex_backend.FUSED_RELATIVE_TRAINED_DEVICES = relative_trained


def encoding(name: str) -> type[torch.nn.Module]:
    """A catalogue encoding by name, or the module of a spec file (built in memory)."""
    if name in ENCODINGS:
        return ENCODINGS[name]
    return encoding_class(module_from_spec(Path(name)))


def per_distance_paths_off(pe: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    """``pe`` with its bias of j - i built per pair (its ``bias_by_distance``,
    ``distance_bias_parameters`` and ``shift_invariant`` off), as for a bias of
    positions."""
    return instance_flags(
        pe, bias_by_distance=False, distance_bias_parameters=(), shift_invariant=False
    )


def sdpa_switches(
    args: argparse.Namespace, pe: torch.nn.Module, device: torch.device, training: bool
) -> list[tuple[str, Callable[[], contextlib.AbstractContextManager[None]]]]:
    """(label, switch) of each sdpa path the ``--compare-*`` flags time switched off (or
    otherwise changed) for ``pe``, beside the path as shipped."""
    if "sdpa" not in args.backends:
        return []
    clipped = pe.clipped_distance or pe.relative_clip
    no_position_term = not (pe.has_position_bias or pe.has_relative_terms)
    wanted = [
        (args.compare_clipped and clipped, "sdpa, no clipped path", clipped_path_off),
        (args.compare_parts and pe.has_relative_terms, "sdpa, dense terms", parts_route_off),
        (
            args.compare_distance_vector and pe.bias_by_distance,
            "sdpa, bias of j - i per pair",
            lambda: distance_vector_off(pe, device),
        ),
        (
            args.compare_floor and pe.has_position_bias,
            "sdpa, no bias floor",
            lambda: bias_floor_off(device),
        ),
        (
            args.compare_chunked and training,
            "sdpa, per-chunk calls",
            lambda: chunked_flash_off(device, False),
        ),
        (
            args.compare_chunked and training,
            "sdpa, per-chunk calls, slices",
            lambda: chunked_flash_off(device, True),
        ),
        (
            args.compare_recomputed and training,
            "sdpa, trained masks per chunk",
            lambda: recomputed_mask_off(device),
        ),
        (
            args.compare_directional and training and pe.distance_bias_parameters,
            "sdpa, no directional path",
            lambda: directional_path_off(device),
        ),
        (
            args.compare_by_distance and pe.bias_by_distance,
            "sdpa, bias per pair",
            lambda: per_distance_paths_off(pe),
        ),
        (
            args.compare_documents and args.documents,
            "sdpa, chunks over every key",
            document_spans_off,
        ),
        (
            args.compare_documents and args.documents and no_position_term,
            "sdpa, one call",
            document_chunks_off,
        ),
        (
            args.compare_documents and args.documents and pe.has_relative_terms,
            "sdpa, terms in one call",
            relative_chunks_off,
        ),
    ]
    return [(label, switch) for on, label, switch in wanted if on]


def candidates(
    args: argparse.Namespace, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> list[tuple[str, str, Callable[[], torch.Tensor], list[torch.Tensor]]]:
    """(encoding, backend, attend, parameters) for every timed candidate."""
    found: list[tuple[str, str, Callable[[], torch.Tensor], list[torch.Tensor]]] = []
    device = q.device
    length = q.shape[2]
    options: dict = {"window": args.window}  # every module call's keywords
    offset = 0 if args.given_positions else args.position_offset  # ids 0 .. N - 1, or K ..
    stride = args.position_stride
    if offset is not None:
        positions = torch.arange(offset, offset + length, device=device) * stride
        options["q_positions"] = options["k_positions"] = positions
    if args.documents:
        options["document_ids"], restarted = packed_documents(length, args.documents, device)
        if args.restart_positions:
            options["q_positions"] = options["k_positions"] = restarted * stride
    if device.type == "cuda" and "flex" in args.backends:
        no_bias = plain_flex(q, k, v, causal, args.window)
        found.append(("(no encoding)", "flex, no bias", no_bias, []))
    for name in [*args.encodings, *args.specs]:
        pe = encoding(name)(heads=args.heads, head_dim=args.head_dim).to(device)
        name = Path(name).stem  # a spec file's name
        limit = getattr(pe, "max_positions", None)
        if limit is not None and length > limit:
            print(f"{name:>14} skipped at N={length}: its table ends at {limit}", flush=True)
            continue
        params = [p for p in pe.parameters() if p.requires_grad]
        for backend in args.backends:
            if backend == "eager" and length > args.max_eager_length:
                continue
            if backend == "flex" and pe.has_value_term:
                continue

            sweep = {"flex": args.flex_options, "sdpa": args.query_chunks}.get(backend, {})
            for label, setting in (sweep or {"": None}).items():

                def attend(pe=pe, backend=backend, setting=setting) -> torch.Tensor:
                    with runtime_setting(backend, setting, device):
                        return pe(q, k, v, causal=causal, backend=backend, **options)

                found.append((name, f"{backend} {label}".strip(), attend, params))
        for label, switch in sdpa_switches(args, pe, device, q.requires_grad):

            def attend_switched(pe=pe, switch=switch) -> torch.Tensor:
                with switch():
                    return pe(q, k, v, causal=causal, backend="sdpa", **options)

            found.append((name, label, attend_switched, params))
        shifted = args.position_offset or (args.documents and args.restart_positions)
        if args.compare_shifted and pe.shift_invariant and shifted:
            for backend in args.backends:

                def attend_as_given(pe=pe, backend=backend) -> torch.Tensor:
                    with shift_recognition_off(pe):
                        return pe(q, k, v, causal=causal, backend=backend, **options)

                found.append((name, f"{backend}, positions as given", attend_as_given, params))
        if "flex" in args.backends and args.compare_clipped and pe.clipped_distance:

            def attend_clipped_flex(pe=pe) -> torch.Tensor:
                with clipped_flex_route_on(device):
                    return pe(q, k, v, causal=causal, backend="flex", **options)

            found.append((name, "flex, clipped gradient", attend_clipped_flex, params))
        fused_forms = pe.bias_by_distance or pe.has_relative_terms
        if "flex" in args.backends and args.compare_fused and fused_forms:
            routes = [(True, False, "flex, fused kernel"), (False, False, "flex, no fused kernel")]
            if params and "train" in args.modes and pe.bias_by_distance:
                routes.append((True, True, "flex, fused kernel, gradient in kernel"))
            for on, trained, label in routes:

                def attend_fused(pe=pe, on=on, trained=trained) -> torch.Tensor:
                    with fused_route(device, on, trained):
                        return pe(q, k, v, causal=causal, backend="flex", **options)

                found.append((name, label, attend_fused, params))
        if "flex" in args.backends and args.distance_vector and pe.bias_by_distance:
            by_vector = ENCODINGS[name](heads=args.heads, head_dim=args.head_dim).to(device)
            by_vector.load_state_dict(pe.state_dict())
            by_vector._flex_bias = lambda *_: None  # read the [H, N + M - 1] vector

            def attend_vector(pe=by_vector) -> torch.Tensor:
                return pe(q, k, v, causal=causal, backend="flex", **options)

            params_vector = [p for p in by_vector.parameters() if p.requires_grad]
            found.append((name, "flex, distance vector", attend_vector, params_vector))
        if name == "t5" and args.hf:
            hf = hf_t5_bias_path(q, k, v, causal, args.window)
            if hf is not None:
                found.append(("t5", "hf T5Attention path", hf[0], hf[1]))
    return found


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    rows = []
    for length in args.lengths:
        shape = (args.batch, args.heads, length, args.head_dim)
        for causal in args.causal:
            for mode in args.modes:
                q, k, v = (
                    torch.randn(shape, device=device, dtype=dtype, requires_grad=mode == "train")
                    for _ in range(3)
                )

                allowed = None  # the window's or documents' boolean mask, built once
                if args.window is not None or args.documents:
                    ids = packed_documents(length, args.documents, device)[0]
                    documents = ids if args.documents else None
                    allowed = window_allowed(length, causal, args.window, device, documents)

                def baseline_attend(q=q, k=k, v=v, causal=causal, allowed=allowed) -> torch.Tensor:
                    if allowed is not None:
                        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                baseline = as_step(baseline_attend, [q, k, v], mode)
                base_mem = peak_extra_bytes(baseline, device)
                for name, backend, attend, params in candidates(args, q, k, v, causal):
                    call = as_step(attend, [q, k, v, *params], mode)
                    try:
                        seconds, base_time = paired_seconds(call, baseline, device, args.repeats)
                        memory = peak_extra_bytes(call, device)
                    except Exception as error:  # noqa: BLE001 - report and go on
                        print(f"{name:>14} {backend:>20} N={length} failed: {error!r}"[:400])
                        continue
                    row = {
                        "encoding": name,
                        "backend": backend,
                        "length": length,
                        "causal": causal,
                        "mode": mode,
                        "seconds": seconds,
                        "baseline_seconds": base_time,
                        "time_ratio": seconds / base_time,
                        "peak_extra_bytes": memory,
                        "baseline_peak_extra_bytes": base_mem,
                    }
                    rows.append(row)
                    extra = f" {memory / 2**20:9.1f} MiB" if memory is not None else ""
                    print(
                        f"{name:>14} {backend:>20} N={length:<5} causal={causal!s:<5} "
                        f"{mode:>7} {seconds * 1e3:9.3f} ms {seconds / base_time:7.2f}x{extra}",
                        flush=True,
                    )
                    del call
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return {
        **report_header(args, device),
        "window": args.window,
        "documents": args.documents,
        "restart_positions": args.restart_positions,
        "given_positions": args.given_positions,
        "position_offset": args.position_offset,
        "position_stride": args.position_stride,
        "flush_denormal": args.flush_denormal,
        "rows": rows,
    }


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    """``--out``: where the result files go; none by default, so that a trial run
    prints its table and never overwrites the committed benchmarks/results."""
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for STEM.json and STEM.md (e.g. benchmarks/results); default: print only",
    )


def write_results(out: Path | None, stem: str, report: dict, table: str) -> None:
    """``out/stem.json`` (the report) and ``out/stem.md`` (its table), then print it;
    only print it where ``out`` is None."""
    print(table)
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{stem}.md").write_text(table)


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()}, {torch.get_num_threads()} threads"


def cpu_model() -> str:
    """The CPU's model name where Linux says it (denormal arithmetic is slow on some CPUs
    and not on others), else the architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def report_header(args: argparse.Namespace, device: torch.device) -> dict:
    """What a report's heading names: device, torch, dtype, batch, heads and head_dim."""
    return {
        "device": describe_device(device),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "batch": args.batch,
        "heads": args.heads,
        "head_dim": args.head_dim,
    }


def header_text(report: dict) -> str:
    """The ``report_header`` fields as a heading's parenthesis names them."""
    return (
        f"{report['device']}, torch {report['torch']}, {report['dtype']}, batch "
        f"{report['batch']}, heads {report['heads']}, head_dim {report['head_dim']}"
    )


def markdown(report: dict) -> str:
    lines = [
        f"# Attention backends vs plain SDPA ({header_text(report)}"
        + (f", window {report['window']}" if report.get("window") is not None else "")
        + (", denormals flushed" if report.get("flush_denormal") else "")
        + (f", {report['documents']} documents" if report.get("documents") else "")
        + (", positions restart per document" if report.get("restart_positions") else "")
        + (", positions given" if report.get("given_positions") else "")
        + (
            f", positions from {report['position_offset']}"
            if report.get("position_offset") is not None
            else ""
        )
        + (
            f", positions {report['position_stride']} apart"
            if report.get("position_stride", 1) != 1
            else ""
        )
        + ")",
        "",
        "Ratio: the candidate's median time over plain "
        "`F.scaled_dot_product_attention(q, k, v, is_causal=causal)` with no position "
        "encoding (FlashAttention on CUDA in half precision), the two timed alternately "
        "in the same loop. `train` is forward plus backward into q, k, v and the "
        "module's parameters. Extra memory: peak allocation beyond the inputs, output "
        "included (CUDA: the allocator's peak; CPU: the profiler's allocation records, "
        "where the table has them). "
        "With a window or documents every candidate gets them, and the baseline is SDPA "
        "with the equivalent boolean mask.",
        "",
        "| encoding | backend | N | causal | mode | ms | ratio | extra MiB | baseline MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        memory = row["peak_extra_bytes"]
        base = row["baseline_peak_extra_bytes"]
        lines.append(
            f"| {row['encoding']} | {row['backend']} | {row['length']} | "
            f"{'yes' if row['causal'] else 'no'} | {row['mode']} | "
            f"{row['seconds'] * 1e3:.3f} | {row['time_ratio']:.2f} | "
            f"{'n/a' if memory is None else f'{memory / 2**20:.1f}'} | "
            f"{'n/a' if base is None else f'{base / 2**20:.1f}'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--encodings", nargs="+", default=DEFAULT_ENCODINGS)
    parser.add_argument(
        "--specs",
        nargs="+",
        default=[],
        help="spec files to time beside the encodings (built in memory, as posgen check does)",
    )
    parser.add_argument(
        "--compare-by-distance",
        action="store_true",
        help="also time each bias of j - i on sdpa with its per-distance paths off (per pair)",
    )
    parser.add_argument("--backends", nargs="+", default=["sdpa", "eager"])
    parser.add_argument("--modes", nargs="+", choices=["forward", "train"], default=["forward"])
    parser.add_argument(
        "--causal",
        choices=["yes", "no", "both"],
        default="yes",
        help="causal masking: yes, no or both",
    )
    parser.add_argument("--hf", action="store_true", help="also time Hugging Face's T5 path")
    parser.add_argument(
        "--distance-vector",
        action="store_true",
        help="also time flex reading the [H, N + M - 1] per-distance vector",
    )
    parser.add_argument(
        "--flex-options",
        nargs="+",
        default=[],
        help='flex kernel options to compare, as JSON ("{}" = FlexAttention defaults)',
    )
    parser.add_argument(
        "--mask-chunk-mib",
        nargs="+",
        default=[],
        help="sdpa: the MiB a query chunk's own mask may take to compare "
        '(masks.SDPA_MASK_CHUNK_BYTES; "none": no cap, chunks of SDPA_QUERY_CHUNK)',
    )
    parser.add_argument(
        "--query-chunks",
        nargs="+",
        default=[],
        help="sdpa queries per call to compare (masks.SDPA_QUERY_CHUNK, with no longer chunks "
        'for long sequences; "none": one call)',
    )
    parser.add_argument(
        "--compare-clipped",
        action="store_true",
        help="also time sdpa without, and flex with, the clipped-bias training path (T5), "
        "and sdpa without the clipped-relative path (Shaw, BERT relative_key, DeBERTa)",
    )
    parser.add_argument(
        "--compare-distance-vector",
        action="store_true",
        help="also time sdpa with a bias of j - i at explicit positions per pair, not read "
        "from a vector over the distances (DISTANCE_VECTOR_DEVICES emptied)",
    )
    parser.add_argument(
        "--compare-floor",
        action="store_true",
        help="also time sdpa with position biases given as they are (no BIAS_FLOOR)",
    )
    parser.add_argument(
        "--compare-chunked",
        action="store_true",
        help="also time sdpa training steps with each query chunk sliced through autograd "
        "(no chunked_flash_attention)",
    )
    parser.add_argument(
        "--given-positions",
        action="store_true",
        help="pass q_positions and k_positions 0 .. N - 1 to every module call (as "
        "Hugging Face-style position ids are)",
    )
    parser.add_argument(
        "--position-offset",
        type=int,
        default=None,
        help="pass q_positions and k_positions K .. K + N - 1 to every module call "
        "(K >= 1: explicit positions that are not the defaults)",
    )
    parser.add_argument(
        "--position-stride",
        type=int,
        default=1,
        help="with --given-positions, --position-offset or --restart-positions, positions "
        "S apart (S >= 2: explicit positions that no shift makes the defaults)",
    )
    parser.add_argument(
        "--compare-recomputed",
        action="store_true",
        help="also time sdpa training steps whose chunk masks train with one call per "
        "chunk through autograd (no recomputed_mask_attention)",
    )
    parser.add_argument(
        "--documents",
        type=int,
        default=0,
        help="pack this many equal documents into each sequence (document_ids)",
    )
    parser.add_argument(
        "--restart-positions",
        action="store_true",
        help="with --documents, positions that restart at each document",
    )
    parser.add_argument(
        "--compare-documents",
        action="store_true",
        help="with --documents, also time sdpa with chunks over every key (no document_spans)",
    )
    parser.add_argument(
        "--compare-shifted",
        action="store_true",
        help="with --position-offset or --restart-positions, also time each "
        "shift-invariant encoding with its shifted positions kept as given (per pair)",
    )
    parser.add_argument(
        "--compare-directional",
        action="store_true",
        help="also time sdpa training steps of KERPLE and trained ALiBi slopes without "
        "their per-scalar flash forwards (no directional_bias_attention)",
    )
    parser.add_argument(
        "--compare-parts",
        action="store_true",
        help="also time sdpa with relative terms built densely, not from their projections",
    )
    parser.add_argument(
        "--compare-fused",
        action="store_true",
        help=(
            "also time flex with and without the fused Triton kernel for biases of j - i "
            "and relative terms (CUDA)"
        ),
    )
    parser.add_argument(
        "--window",
        type=int,
        default=None,
        help="sliding window W for every candidate (the baseline: SDPA with a bool mask)",
    )
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max-eager-length", type=int, default=4096)
    parser.add_argument(
        "--flush-denormal",
        action="store_true",
        help="flush denormals to zero on every CPU thread first (numerics.flush_denormals)",
    )
    parser.add_argument("--tag", default="", help="appended to the result file names")
    add_out_argument(parser)
    args = parser.parse_args()
    explicit = args.given_positions or args.position_offset is not None or args.restart_positions
    if args.position_stride != 1 and not explicit:
        parser.error(
            "--position-stride: give positions with --given-positions, --position-offset "
            "or --restart-positions (without them every call takes the defaults)"
        )
    if args.flush_denormal and not numerics.flush_denormals():
        parser.error("--flush-denormal: denormals are not flushed on every thread")
    args.causal = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
    args.flex_options = {text: json.loads(text) for text in args.flex_options}
    args.query_chunks = {f"chunk {text}": text for text in args.query_chunks}
    for text in args.mask_chunk_mib:  # swept beside the chunk sizes
        args.query_chunks[f"mask chunks {text} MiB"] = ("mask", text)
    # every shape, mask and score_mod is one compilation of flex_attention
    torch._dynamo.config.recompile_limit = flex_runtime.FLEX_RECOMPILE_LIMIT
    report = run(args)
    window = "" if args.window is None else f"_window{args.window}"
    stem = f"attention_backends_{args.device.split(':')[0]}_{args.dtype}{window}{args.tag}"
    write_results(args.out, stem, report, markdown(report))


if __name__ == "__main__":
    main()
