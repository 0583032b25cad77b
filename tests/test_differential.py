"""Random calls, every fast path against the eager oracle.

Hypothesis draws a call (query and key counts, grouped-query heads, causal, window,
positions of several kinds (permuted too), packed documents, an attn_mask of any
broadcast shape, query chunks of 3 or the default) and the sdpa and flex backends must
give eager's output and gradients (into q, k, v and every trained parameter) in
float64. On the CPU flex runs FlexAttention's unfused forms, which call the same
score_mod and mask_mod that the compiled GPU kernel inlines. A differential fuzz of
this kind found five defects (CoPE's count across documents and, with a causal window
at permuted positions, past its chunk's keys; a [M] attn_mask on sdpa and on flex;
Sandwich's precision at large positions); these tests keep the search running in the
suite, small.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import generated_class, runtime_modules

F64 = torch.float64
# one encoding of each kind of term the backends treat differently
NAMES = (
    "nope",
    "rope",
    "rope_gptj",
    "alibi",
    "t5",
    "kerple_log",
    "sandwich",
    "fire",
    "shaw",
    "bert_relative_key_query",
    "deberta",
    "transformer_xl",
    "cope",
    "tupe_r",
)
_MODULES: dict[str, torch.nn.Module] = {}


def _module(name: str) -> torch.nn.Module:
    """The encoding with 4 query heads of width 8, its parameters drawn once."""
    if name not in _MODULES:
        torch.manual_seed(0)
        pe = generated_class(name)(heads=4, head_dim=8).double()
        with torch.no_grad():
            for parameter in pe.parameters():
                parameter.add_(0.1 * torch.randn_like(parameter))
        _MODULES[name] = pe
    return _MODULES[name]


@contextlib.contextmanager
def _query_chunks(size: int | None) -> Iterator[None]:
    """Chunks of ``size`` queries on the CPU for the call (None: as shipped):
    ``SDPA_QUERY_CHUNK``, and the chunks sized by their masks' bytes
    (``SDPA_MASK_CHUNK_BYTES``: CoPE's node, masks that train) cut to ``size`` rows."""
    modules = [module for module in runtime_modules() if module.__name__.endswith("_masks")]
    holders = [
        module for module in runtime_modules() if hasattr(module, "SDPA_MASK_CHUNK_MIN_ROWS")
    ]
    saved = [
        (dict(module.SDPA_QUERY_CHUNK), dict(module.SDPA_MASK_CHUNK_BYTES)) for module in modules
    ]
    saved_rows = [module.SDPA_MASK_CHUNK_MIN_ROWS for module in holders]
    try:
        if size is not None:
            for module in modules:
                module.SDPA_QUERY_CHUNK["cpu"] = size
                module.SDPA_MASK_CHUNK_BYTES["cpu"] = 1
            for module in holders:
                module.SDPA_MASK_CHUNK_MIN_ROWS = size
        yield
    finally:
        for module, (chunks, budgets) in zip(modules, saved, strict=True):
            module.SDPA_QUERY_CHUNK.clear()
            module.SDPA_QUERY_CHUNK.update(chunks)
            module.SDPA_MASK_CHUNK_BYTES.clear()
            module.SDPA_MASK_CHUNK_BYTES.update(budgets)
        for module, rows in zip(holders, saved_rows, strict=True):
            module.SDPA_MASK_CHUNK_MIN_ROWS = rows


@st.composite
def calls(draw: st.DrawFn) -> dict:
    """A call's shapes and keyword arguments (see the module docstring)."""
    n = draw(st.integers(1, 9))
    m = draw(st.integers(n, 14))
    options: dict = {"causal": draw(st.booleans())}
    if draw(st.booleans()):
        options["window"] = draw(st.integers(1, 6))
    documents = None
    if draw(st.booleans()):  # runs of ids, an id possibly in two runs
        runs = draw(st.lists(st.integers(0, 2), min_size=m, max_size=m))
        documents = torch.tensor(sorted(runs) if draw(st.booleans()) else runs)
        options["document_ids"] = documents
    kinds = ["none", "shifted", "restarted", "strided", "increasing", "permuted"]
    kind = draw(st.sampled_from(kinds))
    if kind == "shifted":
        k_positions = torch.arange(m) + draw(st.integers(1, 50))
    elif kind == "restarted" and documents is not None:
        starts = torch.cat([torch.tensor([True]), documents[1:] != documents[:-1]])
        run = torch.cumsum(starts, 0) - 1  # each key's run
        first = torch.nonzero(starts).squeeze(1)  # each run's first key
        k_positions = torch.arange(m) - first[run]
    elif kind == "strided":
        k_positions = 2 * torch.arange(m)
    elif kind == "increasing":
        gaps = draw(st.lists(st.integers(1, 3), min_size=m, max_size=m))
        k_positions = torch.cumsum(torch.tensor(gaps), 0)
    elif kind == "permuted":  # a later key may sit at an earlier position
        k_positions = torch.tensor(draw(st.permutations(range(m))))
    else:
        k_positions = None
    if k_positions is not None:
        options["k_positions"] = k_positions
        options["q_positions"] = k_positions[m - n :]  # the queries are the last N keys
    mask_kind = draw(st.sampled_from(["none", "none", "bool", "float", "per key"]))
    if mask_kind != "none":
        shape = (m,) if mask_kind == "per key" else (n, m)
        count = m if mask_kind == "per key" else n * m
        flags = draw(st.lists(st.booleans(), min_size=count, max_size=count))
        allowed = torch.tensor(flags).view(shape)
        if mask_kind == "float":
            allowed = torch.where(allowed, 0.0, -2.5).to(F64)
        options["attn_mask"] = allowed
    return {
        "name": draw(st.sampled_from(NAMES)),
        "n": n,
        "m": m,
        "kv_heads": draw(st.sampled_from([1, 2, 4])),
        "chunk": draw(st.sampled_from([None, 3])),
        "seed": draw(st.integers(0, 2**16)),
        "options": options,
    }


def _run(pe: torch.nn.Module, inputs: list[torch.Tensor], backend: str, options: dict) -> tuple:
    q, k, v = inputs[:3]
    out = pe(q, k, v, backend=backend, **options)
    grads = torch.autograd.grad(out.square().sum(), inputs, allow_unused=True)
    return out, grads


def _inputs(pe: torch.nn.Module, call: dict) -> list[torch.Tensor]:
    """q, k, v in float64 for the drawn call, then the module's trained parameters."""
    generator = torch.Generator().manual_seed(call["seed"])
    n, m, kv_heads = call["n"], call["m"], call["kv_heads"]
    shapes = ((2, 4, n, 8), (2, kv_heads, m, 8), (2, kv_heads, m, 8))
    inputs = [
        torch.randn(*shape, generator=generator, dtype=F64, requires_grad=True) for shape in shapes
    ]
    return inputs + [p for p in pe.parameters() if p.requires_grad]


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=calls())
def test_sdpa_equals_eager_on_random_calls(call: dict) -> None:
    pe = _module(call["name"])
    inputs = _inputs(pe, call)
    want, want_grads = _run(pe, inputs, "eager", call["options"])
    with _query_chunks(call["chunk"]):
        got, got_grads = _run(pe, inputs, "sdpa", call["options"])
        with torch.no_grad():
            inference = pe(*inputs[:3], backend="sdpa", **call["options"])
    _assert_same(got, got_grads, inference, want, want_grads)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=calls().filter(lambda call: call["name"] != "shaw"))  # flex has no value term
def test_flex_equals_eager_on_random_calls(call: dict) -> None:
    """The score_mod and mask_mod through flex's differentiable reference and, without
    gradients, through FlexAttention's own unfused kernel."""
    pe = _module(call["name"])
    inputs = _inputs(pe, call)
    want, want_grads = _run(pe, inputs, "eager", call["options"])
    got, got_grads = _run(pe, inputs, "flex", call["options"])
    with torch.no_grad():
        inference = pe(*inputs[:3], backend="flex", **call["options"])
    _assert_same(got, got_grads, inference, want, want_grads)


def _assert_same(
    got: torch.Tensor,
    got_grads: tuple,
    inference: torch.Tensor,
    want: torch.Tensor,
    want_grads: tuple,
) -> None:
    """A backend's output, gradients and no-grad output against eager's, float64 tight."""
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(inference, want.detach(), rtol=1e-9, atol=1e-11)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        if want_grad is None:
            assert got_grad is None or not bool(got_grad.any())
            continue
        assert got_grad is not None
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-8, atol=1e-10)
