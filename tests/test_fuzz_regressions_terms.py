"""Regressions from a differential fuzz of term combinations: each module against the
eager oracle in float64, outputs and the gradients into q, k, v and every parameter.

- CoPE beside a position bias, an untied term or a global content term: the sdpa
  backend's counted node (``_sdpa_counted``, from COUNTED_MIN_QUERIES queries) formed
  the content logits and CoPE's term alone, dropping the others.
- CoPE beside a global content term: the contextual and relative blocks each rendered
  ``_relative_terms``; the later (the global term alone) replaced CoPE's, so CoPE
  vanished from eager and flex. The source gate now refuses a class that defines a
  method twice.
- An untied term beside relative, global or CoPE terms: flex folded it into extra
  features of q and k before those terms read them (a shape error).
- xPos beside a term that reads q or k alone (a relative term, the global content
  term, CoPE): its reference point, the middle of the call's key positions, did not
  cancel there, so a query's output changed with the keys a call held (refused now).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch

from posgen.codegen.inmemory import encoding_class, module_from_spec
from posgen.codegen.render import SourceGateError, check_source
from posgen.spec.diagnostics import SpecError
from tests.conftest import generated_class, run_backend, spy_method

F64 = torch.float64
_FOLDER = tempfile.TemporaryDirectory(prefix="posgen-fuzz-terms-")

COPE = "contextual: {kind: cope, max_positions: 8}"
GLOBAL_AFTER = "global: {placement: after_scale, init_std: 0.3}"
GLOBAL_BEFORE = "global: {placement: before_scale, init_std: 0.3}"
UNTIED = (
    "untied: {table: {kind: learned, max_positions: 64}, norm: {kind: none}, "
    "projection_bias: false, first_token: shared}"
)
ALIBI_LEARNED = (
    "bias: {kind: linear_slopes, slopes: learned, distance: absolute, placement: after_scale}"
)
T5 = (
    "bias: {kind: learned_table, index: {kind: log_buckets, recipe: t5, buckets: 8, "
    "max_distance: 16, bidirectional: true, sign: key_minus_query}, placement: after_scale}"
)
KERPLE = "bias: {kind: kerple, variant: log, placement: after_scale}"
SANDWICH = "bias: {kind: sandwich, dim: 8, base: 10000, per_head: divided, placement: after_scale}"
EXPR = (
    'bias: {kind: expr, expr: "-s[h] * abs(i - j) + 0.1 * i", '
    "params: {s: {shape: [heads], init: 0.5}}, placement: before_scale}"
)
CLIPPED_RELATIVE = "relative: {sign: query_minus_key, projection: none, placement: before_scale}"
RELATIVE_INDEX = "relative:\n  index: {kind: clip, max_distance: 2}\n"  # a value term's
RELATIVE_SECTION = (
    RELATIVE_INDEX + "  table: {kind: learned, width: head_dim, heads: shared, init_std: 0.3}\n"
)

SPEC = """\
name: {name}
title: a fuzzed combination of terms
references: [fuzz]
defaults: {{heads: 4, head_dim: 8, model_dim: 16}}
scale: inv_sqrt_head_dim
{relative}terms:
  content_content: keep
  content_position: {cp}
  position_content: {pc}
  position_position: {pp}
claims: {{}}
"""

# name -> (content_position, position_content, position_position)
COPE_BESIDE = {
    "cope_alibi_learned": (COPE, "drop", ALIBI_LEARNED),
    "cope_t5": (COPE, "drop", T5),
    "cope_kerple": (COPE, "drop", KERPLE),
    "cope_sandwich": (COPE, "drop", SANDWICH),
    "cope_expr": (COPE, "drop", EXPR),
    "cope_untied": (COPE, "drop", UNTIED),
    "cope_global": (COPE, GLOBAL_AFTER, "drop"),
    "cope_global_inside": (COPE, GLOBAL_BEFORE, "drop"),
    "cope_global_alibi": (COPE, GLOBAL_AFTER, ALIBI_LEARNED),
    "cope_global_untied": (COPE, GLOBAL_BEFORE, UNTIED),
}
UNTIED_BESIDE = {
    "untied_global": ("drop", GLOBAL_BEFORE, UNTIED),
    "untied_relative": (CLIPPED_RELATIVE, "drop", UNTIED),
    "untied_cope": (COPE, "drop", UNTIED),
}


@functools.cache
def _class(name: str) -> type[torch.nn.Module]:
    cp, pc, pp = {**COPE_BESIDE, **UNTIED_BESIDE}[name]
    relative = RELATIVE_SECTION if "relative:" in cp else ""
    cp, pc, pp = (term if term == "drop" else f"{{{term}}}" for term in (cp, pc, pp))
    text = SPEC.format(name=name, relative=relative, cp=cp, pc=pc, pp=pp)
    path = Path(_FOLDER.name) / f"{name}.yaml"
    path.write_text(text, encoding="utf-8")
    return encoding_class(module_from_spec(path))


def _module(name: str) -> torch.nn.Module:
    """The combination in float64, its parameters moved off their initialisation (a
    zero-initialised table would hide a term)."""
    torch.manual_seed(0)
    pe = _class(name)(heads=4, head_dim=8).double()
    with torch.no_grad():
        for parameter in pe.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
    return pe


def _assert_backends_match_eager(
    pe: torch.nn.Module, n: int, m: int, kv_heads: int, backends: tuple[str, ...], **options: object
) -> None:
    """Each backend's output and gradients (q, k, v and every parameter) equal eager's."""
    generator = torch.Generator().manual_seed(n + 10 * kv_heads)
    shapes = {"q": (2, 4, n, 8), "k": (2, kv_heads, m, 8), "v": (2, kv_heads, m, 8)}
    inputs = {
        key: torch.randn(*shape, generator=generator, dtype=F64) for key, shape in shapes.items()
    }
    eager, eager_grads = run_backend(pe, inputs, "eager", **options)
    # every parameter reaches the oracle's logits (none of the terms is dropped)
    assert len(eager_grads) == 3 + len(list(pe.parameters()))
    for backend in backends:
        out, grads = run_backend(pe, inputs, backend, **options)
        torch.testing.assert_close(out, eager, rtol=1e-10, atol=1e-12, msg=backend)
        assert len(grads) == len(eager_grads), backend
        for got, want in zip(grads, eager_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11, msg=backend)


@pytest.mark.parametrize("name", sorted(COPE_BESIDE))
@pytest.mark.parametrize("explicit", [False, True])
def test_cope_beside_other_terms_matches_eager_on_every_backend(name: str, explicit: bool) -> None:
    """From COUNTED_MIN_QUERIES (6) queries the sdpa backend's counted node served CoPE
    and dropped the bias, untied or global term beside it (output off by 0.2, the
    slopes without gradient); now only CoPE alone takes that node."""
    pe = _module(name)
    assert not pe.counted_terms_alone
    for n, causal, kv_heads in ((6, True, 4), (7, False, 2), (12, True, 2)):
        options: dict[str, object] = {"causal": causal}
        if explicit:
            keys = torch.tensor([0, 2, 3, 5, 8, 9, 11, 14, 15, 17, 20, 21])[:n]
            options.update(q_positions=keys, k_positions=keys)
        _assert_backends_match_eager(pe, n, n, kv_heads, ("sdpa", "flex", "auto"), **options)


def test_cope_alone_keeps_the_counted_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain CoPE still takes the counted node (its fast path) and matches eager."""
    cope = generated_class("cope")(heads=4, head_dim=8).double()
    assert cope.counted_terms_alone
    calls = spy_method(monkeypatch, type(cope), "_sdpa_counted", lambda *_, **__: None)
    _assert_backends_match_eager(cope, 8, 8, 2, ("sdpa",), causal=True)
    assert calls


@pytest.mark.parametrize("placement", ["cope_global", "cope_global_inside"])
def test_cope_beside_a_global_content_term_renders_both(placement: str) -> None:
    """The contextual and relative blocks each rendered ``_relative_terms``; the later
    (the global term alone) replaced CoPE's: score_terms had no content_position and
    cope_positions no gradient on the eager backend."""
    pe = _module(placement)
    q, k = torch.randn(1, 4, 5, 8, dtype=F64), torch.randn(1, 4, 5, 8, dtype=F64)
    terms = pe.score_terms(q, k)
    assert {"content_content", "content_position", "position_content"} <= set(terms)
    v = torch.randn(1, 4, 5, 8, dtype=F64)
    out = pe(q, k, v, causal=True, backend="eager")
    (grad,) = torch.autograd.grad(out.square().sum(), [pe.cope_positions])
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("name", sorted(UNTIED_BESIDE))
def test_untied_beside_terms_that_read_q_and_k_does_not_fold(name: str) -> None:
    """flex folded the untied term into extra features of q and k before relative,
    global or CoPE terms read them ("Expected size ... [2, 4] but got [2, 8]", "mat1
    and mat2 shapes cannot be multiplied"): such a module now never folds."""
    pe = _module(name)
    assert not pe.folds_position_bias
    for fold in (None, True):
        pe.fold_bias = fold
        for n, causal, kv_heads in ((1, True, 2), (5, False, 4), (7, True, 2)):
            _assert_backends_match_eager(
                pe, n, n + 2, kv_heads, ("sdpa", "flex", "auto"), causal=causal
            )


def test_source_gate_refuses_a_method_defined_twice() -> None:
    """A class with two ``def`` of one name (the later silently replaces the earlier) is
    refused; a property's setter and overload stubs are not."""
    twice = "class A:\n    def f(self):\n        return 1\n\n    def f(self):\n        return 2\n"
    with pytest.raises(SourceGateError, match="defines 'f' twice"):
        check_source(twice, "twice.py")
    setter = (
        "class A:\n    @property\n    def x(self):\n        return 1\n\n"
        "    @x.setter\n    def x(self, value):\n        pass\n"
    )
    check_source(setter, "setter.py")


XPOS_SPEC = SPEC.replace(
    "  content_content: keep\n",
    "  content_content:\n"
    "    rotate: {{base: 10000, pairing: half, position_scale: {{kind: xpos, scale_base: 4}}}}\n",
)
VALUE_TERM = "values: {relative: {sign: key_minus_query, heads: shared}}\n"
GLOBAL_POSITION = "global: {sign: query_minus_key, projection: none, placement: before_scale}"
KEY_RELATIVE = "relative: {sign: query_minus_key, projection: none, placement: before_scale}"


def _xpos_path(name: str, cp: str, pc: str, pp: str, extra: str = "") -> Path:
    """A spec rotating with xPos (scale_base 4) beside the given terms."""
    relative = ""
    if "relative" in cp + pc or pp.startswith("global"):
        relative = RELATIVE_SECTION
    elif extra:  # a value term reads the index alone
        relative = RELATIVE_INDEX
    cp, pc, pp = (term if term == "drop" else f"{{{term}}}" for term in (cp, pc, pp))
    text = XPOS_SPEC.format(name=name, relative=relative, cp=cp, pc=pc, pp=pp)
    path = Path(_FOLDER.name) / f"{name}.yaml"
    path.write_text(text.replace("claims:", f"{extra}claims:"), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("name", "terms", "reader"),
    [
        ("xpos_query_relative", (CLIPPED_RELATIVE, "drop", "drop"), "content_position"),
        ("xpos_key_relative", ("drop", KEY_RELATIVE, "drop"), "position_content"),
        ("xpos_global_content", ("drop", GLOBAL_BEFORE, "drop"), "position_content"),
        ("xpos_cope", (COPE, "drop", "drop"), "content_position"),
    ],
)
def test_xpos_beside_a_term_that_reads_q_or_k_alone_is_refused(
    name: str, terms: tuple[str, str, str], reader: str
) -> None:
    """xPos scales q and k about the middle of each call's key positions (c); c cancels
    in q·k but not in q·R, k·R, u·k_j or CoPE's q·e, which then changed with the keys a
    call held: a prefill of 6 tokens differed from the first 6 rows of a call of 12 by
    up to 0.49 in float64. Such a spec is refused, naming position_scale and the term."""
    with pytest.raises(SpecError) as refused:
        module_from_spec(_xpos_path(name, *terms))
    message = str(refused.value)
    assert "terms.content_content.rotate.position_scale" in message
    assert f"terms.{reader} reads q or k alone" in message


@pytest.mark.parametrize(
    ("name", "terms", "extra"),
    [
        ("xpos_alibi", ("drop", "drop", ALIBI_LEARNED), ""),
        ("xpos_t5", ("drop", "drop", T5), ""),
        ("xpos_global_position", ("drop", "drop", GLOBAL_POSITION), ""),
        ("xpos_values", ("drop", "drop", "drop"), VALUE_TERM),
    ],
)
def test_xpos_beside_terms_of_positions_alone_keeps_a_causal_prefix(
    name: str, terms: tuple[str, str, str], extra: str
) -> None:
    """Beside terms that read positions alone (a bias, the global position term, a
    relative value term) xPos's reference point cancels: under a causal mask a prefill's
    rows, a decode step and a step over a cache of rotated keys equal the rows of the
    whole call, on eager and sdpa."""
    torch.manual_seed(0)
    pe = encoding_class(module_from_spec(_xpos_path(name, *terms, extra)))(heads=4, head_dim=8)
    pe = pe.double()
    with torch.no_grad():
        for parameter in pe.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 12, 8, generator=generator, dtype=F64) for _ in range(3))
    step = {"q_positions": torch.tensor([6]), "k_positions": torch.arange(7), "causal": True}
    with torch.no_grad():
        for backend in ("eager", "sdpa"):
            whole = pe(q, k, v, causal=True, backend=backend)
            prefill = pe(q[:, :, :6], k[:, :, :6], v[:, :, :6], causal=True, backend=backend)
            one = pe(q[:, :, 6:7], k[:, :, :7], v[:, :, :7], backend=backend, **step)
            rotated = pe.rotate_keys(k[:, :, :7], torch.arange(7))
            cached = pe(
                q[:, :, 6:7], rotated, v[:, :, :7], backend=backend, keys_rotated=True, **step
            )
            torch.testing.assert_close(prefill, whole[:, :, :6], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(one, whole[:, :, 6:7], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(cached, whole[:, :, 6:7], rtol=1e-10, atol=1e-12)
