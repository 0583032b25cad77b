"""Every module traces whole under torch.compile(fullgraph=True), with explicit positions
too, on both backends, and gives the eager module's outputs.

The CPU suite compiles with ``backend="eager"``: TorchDynamo traces the full graph (a
graph break or a host sync fails ``fullgraph``) without paying for inductor's code
generation, except for the cases that inductor's CPU code got wrong (a case of each
way a tensor reaches the flex kernel, a training step of a table every head shares);
benchmarks/compile_sweep.py compiles every module with inductor, and tests/test_gpu.py
compiles with inductor on CUDA. Value checks that need a host sync (negative or
too-large positions, positions past a learned table) run in eager mode only.
"""

from __future__ import annotations

import importlib
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from posgen.codegen.inmemory import encoding_class, module_from_spec
from tests.conftest import (
    generated_class,
    head_dim_for,
    runtime_modules,
    runtime_value,
    set_runtime,
    spec_names,
    spy_calls,
)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


EXPLICIT = {"q_positions": torch.tensor([3, 4, 5, 6, 7]), "k_positions": torch.arange(7)}


def _module_and_inputs(
    name: str, width: int
) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The encoding with 4 query heads over 2 key/value heads, and q [1, 4, 5, d],
    k and v [1, 2, 7, d] (grouped-query; the queries are the last five positions)."""
    d = head_dim_for(name, width)
    pe = generated_class(name)(heads=4, head_dim=d).eval()
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, d, generator=generator)
    k, v = (torch.randn(1, 2, 7, d, generator=generator) for _ in "kv")
    return pe, q, k, v


@pytest.mark.parametrize("name", spec_names())
def test_fullgraph_compile_matches_eager_module(name: str) -> None:
    pe, q, k, v = _module_and_inputs(name, 8)
    explicit = EXPLICIT
    compiled = torch.compile(pe, fullgraph=True, backend="eager")
    for positions in ({}, explicit):
        for backend in ("eager", "sdpa"):
            want = pe(q, k, v, causal=True, backend=backend, **positions)
            got = compiled(q, k, v, causal=True, backend=backend, **positions)
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "name",
    # flex refuses a value-side term (it needs the attention weights)
    [name for name in spec_names() if not generated_class(name).has_value_term],
)
def test_fullgraph_compile_of_the_flex_backend(name: str) -> None:
    """backend="flex" traces whole too (its score_mod's closure is never introspected in
    the forward), default and explicit positions, causal, without autograd (FlexAttention
    has no CPU backward; with gradients the CPU runs the unfused reference)."""
    pe, q, k, v = _module_and_inputs(name, 16)
    explicit = EXPLICIT
    compiled = torch.compile(pe, fullgraph=True, backend="eager")
    with torch.no_grad():
        for positions in ({}, explicit):
            want = pe(q, k, v, causal=True, backend="eager", **positions)
            got = compiled(q, k, v, causal=True, backend="flex", **positions)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["alibi", "t5", "rope", "fire", "deberta", "transformer_xl"])
def test_fullgraph_compile_of_sdpa_query_chunks(name: str, monkeypatch) -> None:
    """The per-chunk SDPA calls (``SDPA_QUERY_CHUNK``) trace whole: of a masked bias of
    j - i, of a window without a bias, and of biases and relative terms built at each
    chunk's positions, with packed documents too. Their key spans come from shapes
    alone (``document_spans`` narrows nothing while compiling)."""
    masks = importlib.import_module("generated._masks")
    monkeypatch.setitem(masks.SDPA_QUERY_CHUNK, "cpu", 2)
    pe, q, k, v = _module_and_inputs(name, 8)
    compiled = torch.compile(pe, fullgraph=True, backend="eager")
    documents = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    for options in (
        {"window": None},
        {"window": 3},
        {"document_ids": documents},
        {"document_ids": documents, **EXPLICIT},
    ):
        want = pe(q, k, v, causal=True, backend="eager", **options)
        got = compiled(q, k, v, causal=True, backend="sdpa", **options)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["bert_relative_key_query", "deberta", "transformer_xl"])
def test_fullgraph_compile_of_relative_terms_from_their_projections(name: str, monkeypatch) -> None:
    """More than a few queries at default positions: each chunk's terms gathered from
    the projections (``_sdpa_relative_parts``) trace whole, causal or not, windowed,
    with gradients into q."""
    masks = importlib.import_module("generated._masks")
    monkeypatch.setitem(masks.SDPA_QUERY_CHUNK, "cpu", 8)
    d = head_dim_for(name, 8)
    pe = generated_class(name)(heads=4, head_dim=d).eval()
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 20, d, generator=generator, requires_grad=True)
    k, v = (torch.randn(1, 2, 24, d, generator=generator) for _ in "kv")
    compiled = torch.compile(pe, fullgraph=True, backend="eager")
    for options in ({"causal": False}, {"causal": True}, {"causal": True, "window": 5}):
        want = pe(q, k, v, backend="eager", **options)
        got = compiled(q, k, v, backend="sdpa", **options)
        torch.testing.assert_close(got, want)
        (want_grad,) = torch.autograd.grad(want.square().sum(), q)
        (got_grad,) = torch.autograd.grad(got.square().sum(), q)
        torch.testing.assert_close(got_grad, want_grad)


@pytest.mark.parametrize("name", spec_names())
def test_a_decoding_loop_over_a_static_cache_compiles_once(name: str) -> None:
    """A decoding loop for CUDA graphs keeps its shapes fixed: the cache has S slots,
    the first L_b of row b hold keys, the query's position L_b - 1 is a tensor and
    ``attn_mask`` hides the empty slots. Four such steps (L growing by one, two rows of
    different lengths, grouped-query heads, rotated keys where the encoding rotates)
    trace one graph, and each row matches the eager oracle on its filled keys alone."""
    d = head_dim_for(name, 8)
    pe = generated_class(name)(heads=4, head_dim=d).eval()
    generator = torch.Generator().manual_seed(0)
    slots = 12
    keys, values = (torch.randn(2, 2, slots, d, generator=generator) for _ in "kv")
    rotated = bool(pe.has_rotation)
    cache = pe.rotate_keys(keys) if rotated else keys
    graphs: list[torch.fx.GraphModule] = []

    def counting_backend(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(graph)
        return graph.forward

    compiled = torch.compile(pe, fullgraph=True, backend=counting_backend)
    with torch.no_grad():
        for step in range(4):
            lengths = torch.tensor([3, 6]) + step  # filled slots per row
            q = torch.randn(2, 4, 1, d, generator=generator)
            position = (lengths - 1)[:, None]  # [2, 1]
            filled = torch.arange(slots)[None, :] < lengths[:, None]  # [2, S]
            got = compiled(
                q,
                cache,
                values,
                q_positions=position,
                attn_mask=filled[:, None, None, :],
                keys_rotated=rotated,
            )
            for row, length in enumerate(lengths.tolist()):
                want = pe(
                    q[row : row + 1],
                    cache[row : row + 1, :, :length],
                    values[row : row + 1, :, :length],
                    q_positions=position[row],
                    keys_rotated=rotated,
                    backend="eager",
                )
                torch.testing.assert_close(got[row : row + 1], want)
    assert len(graphs) == 1


@pytest.mark.parametrize("name", ["alibi", "t5", "rope", "kerple_log"])
def test_fullgraph_compile_of_a_grouped_query_decode_step(name: str, monkeypatch) -> None:
    """A decode step under grouped-query heads runs as the grouped matmuls
    (``grouped_query_attention``, here at any key count) and traces whole: one query at
    default positions, and two at explicit ones, causal."""
    set_runtime(monkeypatch, "GROUPED_QUERY_MIN_KEY_ELEMENTS", 0)
    ran = spy_calls(monkeypatch, runtime_modules(), "grouped_query_attention", lambda *_, **__: 1)
    pe, q, k, v = _module_and_inputs(name, 8)
    compiled = torch.compile(pe, fullgraph=True, backend="eager")
    explicit = {"q_positions": torch.tensor([5, 6]), "k_positions": torch.arange(7)}
    for rows, options in ((q[:, :, -1:], {}), (q[:, :, -2:], {"causal": True, **explicit})):
        want = pe(rows, k, v, backend="eager", **options)
        got = compiled(rows, k, v, backend="sdpa", **options)
        torch.testing.assert_close(got, want)
    assert ran


NEEDS_CPP = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="inductor's CPU code needs a C++ compiler",
)

SHIFTED_ROWS = {  # batched positions: the second row five steps on
    "q_positions": torch.tensor([[2, 3, 4, 5, 6], [7, 8, 9, 10, 11]]),
    "k_positions": torch.tensor([[0, 1, 2, 3, 4, 5, 6], [5, 6, 7, 8, 9, 10, 11]]),
}

INDUCTOR_CASES = [
    # (encoding, backend, the call's options), each a way a tensor enters the kernel
    ("alibi", "flex", SHIFTED_ROWS),  # slopes made in the graph; rows of positions
    ("alibi", "flex", {"document_ids": torch.tensor([0, 0, 0, 1, 1, 1, 1])}),
    ("t5", "flex", EXPLICIT),  # a vector gathered from the bucket table
    ("kerple_log", "flex", {}),  # trained scalars clamped in the graph
    ("fire", "flex", EXPLICIT),  # an MLP's weights, each query's normaliser
    ("sandwich", "flex", {}),  # a per-distance vector
    ("kerple_log_expr", "flex", EXPLICIT),  # an expression's parameters
    ("deberta", "flex", {}),  # projections read on their diagonals
    ("bert_relative_key", "flex", SHIFTED_ROWS),  # clipped projections at positions
    ("cope", "flex", {}),  # a dense term captured whole
    ("rope_gptj", "flex", {}),  # q and k rotated by pairs, flattened from 5-D
    ("transformer_xl", "flex", EXPLICIT),  # the distinct distances: a count from data
    ("transformer_xl", "sdpa", SHIFTED_ROWS),
]


@NEEDS_CPP
@pytest.mark.parametrize(("name", "backend", "options"), INDUCTOR_CASES)
def test_inductor_compiles_the_cpu_kernels(
    name: str, backend: str, options: dict[str, torch.Tensor]
) -> None:
    """Compiled whole by inductor (the default backend) on the CPU, causal, grouped-query
    heads, without autograd, the module gives eager mode's outputs. On the flex backend
    every tensor the score_mod or mask_mod captures reaches the kernel as a buffer of its
    own (``own_buffer_on_cpu``), as do q, k and v: inductor's CPU FlexAttention refused
    tensors still fused into the graph (ALiBi's slopes, T5's vector), views of one, and
    q flattened from 5-D. Transformer-XL's distinct distances at given positions are a
    count known only from the data, which inductor's matmul needs bounded (both
    backends). About 4-10 s per case on the 2-core CPU."""
    if name == "kerple_log_expr":  # KERPLE-log written as an expression
        spec = Path(__file__).parent / "specs" / "expr" / "kerple_log_expr.yaml"
        d, encoding = 16, encoding_class(module_from_spec(spec))
    else:
        d, encoding = head_dim_for(name, 16), generated_class(name)
    pe = encoding(heads=4, head_dim=d).eval()
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, d, generator=generator)
    k, v = (torch.randn(2, 2, 7, d, generator=generator) for _ in "kv")
    compiled = torch.compile(pe, fullgraph=True)
    with torch.no_grad():
        want = pe(q, k, v, causal=True, backend="eager", **options)
        got = compiled(q, k, v, causal=True, backend=backend, **options)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@NEEDS_CPP
def test_inductor_trains_a_table_shared_by_every_head() -> None:
    """BERT's relative_key_query reads one learned row per distance, shared by every
    head, on the query side and the key side. Compiled by inductor, a training step's
    gradient into ``distance_embedding`` was off by its own size (the backward's sum
    over the heads and its scatter into the table fused into one vectorised loop that
    stepped two features at a time; ``own_buffer_on_cpu`` keeps them apart). Outputs
    and gradients into q, k, v and the table equal eager mode's (one compilation with
    its backward: about 10 s on the 2-core CPU)."""
    pe = generated_class("bert_relative_key_query")(heads=4, head_dim=16).eval()
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 16, generator=generator)
    k, v = (torch.randn(2, 2, 7, 16, generator=generator) for _ in "kv")
    compiled = torch.compile(pe, fullgraph=True)
    results = []
    for module, backend in ((pe, "eager"), (compiled, "sdpa")):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = module(*leaves, causal=True, backend=backend)
        wrt = [*leaves, pe.distance_embedding.weight]
        results.append([out, *torch.autograd.grad(out.square().sum(), wrt)])
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@NEEDS_CPP
def test_inductor_compiles_a_trained_distance_vector_in_query_chunks(monkeypatch) -> None:
    """A trained bias of j - i in query chunks, each a strided view of a slice of the
    per-distance vector: compiled with inductor (the default backend), an as_strided of
    a slice read the vector from its start, not from the slice (KERPLE's outputs off by
    3, NaN gradients; T5's too where causal). Outputs and gradients into q and the
    parameters equal eager's, causal (one compilation: about 25 s cold on the 2-core CPU).
    Inductor, not dynamo alone: the eager and aot_eager backends kept the view's
    offset."""
    masks = importlib.import_module("generated._masks")
    monkeypatch.setitem(masks.SDPA_QUERY_CHUNK, "cpu", 8)
    pe = generated_class("kerple_log")(heads=4, head_dim=8)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 20, 8, generator=generator, requires_grad=True)
    k, v = (torch.randn(1, 2, 24, 8, generator=generator) for _ in "kv")
    compiled = torch.compile(pe, fullgraph=True)
    leaves = [q, *pe.parameters()]
    want = pe(q, k, v, backend="eager", causal=True)
    got = compiled(q, k, v, backend="sdpa", causal=True)
    torch.testing.assert_close(got, want)
    want_grads = torch.autograd.grad(want.square().sum(), leaves)
    got_grads = torch.autograd.grad(got.square().sum(), leaves)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-5)


COMPILED_ROTATIONS = [
    *[
        (name, "default")
        for name in ["rope", "rope_gptj", "rope_partial", "rope_xpos", "rope_mrope"]
    ],
    ("rope_gptj", "formula"),  # interleaved pairs as CUDA compiles them
]


@pytest.mark.parametrize(("name", "route"), COMPILED_ROTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_rotation_matches_eager_with_gradients(
    name: str, route: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torch.compile the rotation takes its own form (``rotate_by_halves``, the
    cos and sin tables through the opaque ``posgen::materialize``; on the CPU,
    interleaved pairs through the opaque ``posgen::rotate``); outputs and the gradients
    into q and k equal eager mode's, in float32 and bfloat16. The "formula" route
    empties ``EAGER_ROTATION_UNDER_COMPILE``, so interleaved pairs trace as on CUDA."""
    if route == "formula":
        rotation = importlib.import_module("generated._rotation")
        monkeypatch.setattr(rotation, "EAGER_ROTATION_UNDER_COMPILE", set())
    d = head_dim_for(name, 16)
    pe = generated_class(name)(heads=4, head_dim=d)
    generator = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 4, 6, d, generator=generator).to(dtype) for _ in "qk")
    cotangents = [torch.randn(2, 4, 6, d, generator=generator).to(dtype) for _ in "qk"]
    compiled = torch.compile(pe.rotate, fullgraph=True, backend="aot_eager")
    results = []
    for rotate in (pe.rotate, compiled):
        leaves = [q.clone().requires_grad_(), k.clone().requires_grad_()]
        outs = rotate(*leaves)
        grads = torch.autograd.grad(outs, leaves, cotangents)
        results.append([t.float() for t in (*outs, *grads)])
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, **tolerance)


@pytest.mark.parametrize(("name", "interleaved"), [("rope_gptj", True), ("rope", False)])
@pytest.mark.parametrize("large", [False, True])
def test_compiled_cpu_rotation_is_the_eager_op_for_large_interleaved_pairs_only(
    name: str, interleaved: bool, large: bool
) -> None:
    """On the CPU a traced interleaved rotation of q and k of at least
    OPAQUE_TABLE_MIN_ELEMENTS elements each is one ``posgen::rotate`` call (the eager
    complex product, faster there than inductor's code); a smaller one (a decode
    step's, where the op's call costs more than it saves) and the half pairing are
    traced as ``rotate_by_halves`` for inductor to fuse."""
    d = head_dim_for(name, 16)
    pe = generated_class(name)(heads=2, head_dim=d)
    threshold = runtime_value("OPAQUE_TABLE_MIN_ELEMENTS", pe)
    rows = threshold // (2 * d) if large else threshold // (2 * d) - 1  # [1, 2, rows, d]
    q, k = torch.randn(1, 2, rows, d), torch.randn(1, 2, rows, d)
    opaque = interleaved and large
    targets: list[object] = []

    def record(graph: torch.fx.GraphModule, inputs: object) -> object:
        targets.extend(node.target for node in graph.graph.nodes)
        return graph.forward

    torch.compile(pe.rotate, fullgraph=True, backend=record)(q, k)
    assert (torch.ops.posgen.rotate.default in targets) is opaque
