"""Decoding with a cache: keys rotated once by ``rotate_keys`` and attended with
``keys_rotated=True`` give, step by step, the rows of the full causal forward."""

from __future__ import annotations

import copy
import importlib
import sys

import pytest
import torch

from generated import parameters_frozen
from tests.conftest import (
    HostReads,
    generated_class,
    head_dim_for,
    runtime_modules,
    runtime_value,
    set_runtime,
    spec_names,
    spec_variant,
    spy_calls,
    spy_method,
)

STEPS = 6


@pytest.mark.parametrize("name", spec_names())
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("explicit", [False, True])
def test_decode_with_rotated_key_cache_matches_full_forward(
    name: str, backend: str, explicit: bool
) -> None:
    torch.manual_seed(0)
    d = head_dim_for(name, 8)
    pe = generated_class(name)(heads=4, head_dim=d).double().eval()  # deterministic positions
    generator = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 4, STEPS, d, generator=generator, dtype=torch.float64) for _ in "qk")
    v = torch.randn(2, 2, STEPS, 8, generator=generator, dtype=torch.float64)
    k = k[:, :2]  # grouped-query: 2 key/value heads for 4 query heads
    # without explicit positions the cache holds keys 0 .. t and the query is the newest
    # explicit: every other position from 3, which no encoding takes for the defaults
    positions = torch.arange(3, 3 + 2 * STEPS, 2) if explicit else torch.arange(STEPS)
    full = pe(q, k, v, causal=True, backend="eager", q_positions=positions, k_positions=positions)
    cache = k[:, :, :0]
    for t in range(STEPS):
        new_key = pe.rotate_keys(k[:, :, t : t + 1], positions[t : t + 1])  # once, at t
        cache = torch.cat((cache, new_key), dim=2)
        kwargs = {"q_positions": positions[t : t + 1], "k_positions": positions[: t + 1]}
        step = pe(
            q[:, :, t : t + 1],
            cache,
            v[:, :, : t + 1],
            causal=True,
            backend=backend,
            keys_rotated=True,
            **(kwargs if explicit else {}),
        )
        torch.testing.assert_close(step, full[:, :, t : t + 1], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["nope", "rope", "alibi", "t5", "deberta", "transformer_xl"])
def test_causal_masks_nothing_for_one_query_at_the_newest_position(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step's one query at the default position M - 1 has no key after it:
    the sdpa backend runs it without the causal mask (which cost about 30 us a step),
    the eager oracle keeps the mask, and the two agree. A query at an explicit earlier
    position keeps the mask."""
    d = head_dim_for(name, 8)
    pe = generated_class(name)(heads=4, head_dim=d).double().eval()
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 1, d, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 9, d, generator=generator, dtype=torch.float64) for _ in "kv")
    seen = spy_method(monkeypatch, type(pe), "_sdpa_attention", lambda *args, **_: args[5])
    for q_positions, masked in (
        (None, False),
        (torch.tensor([8]), False),
        (torch.tensor([5]), True),
    ):
        seen.clear()
        out = pe(q, k, v, causal=True, backend="sdpa", q_positions=q_positions)
        assert seen == [masked]
        oracle = pe(q, k, v, causal=True, backend="eager", q_positions=q_positions)
        torch.testing.assert_close(out, oracle, rtol=1e-10, atol=1e-12)
    # the earlier query reads keys 0 .. 5 only
    unmasked = pe(q, k, v, backend="eager", q_positions=torch.tensor([5]))
    assert not torch.allclose(out, unmasked)


def test_rotate_keys_is_the_key_half_of_rotate() -> None:
    pe = generated_class("rope_gptj")(heads=2, head_dim=8)
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)
    positions = torch.tensor([[7, 9, 10, 11, 20]])
    _, rotated = pe.rotate(q, k, k_positions=positions, q_positions=positions[:, -3:])
    torch.testing.assert_close(pe.rotate_keys(k, positions), rotated, rtol=0, atol=0)
    assert generated_class("alibi")(heads=2, head_dim=8).rotate_keys(k) is k
    with pytest.raises(ValueError, match="positions must have shape"):
        pe.rotate_keys(k, torch.arange(4))


@pytest.mark.parametrize(
    ("name", "start"),
    [("rope_dynamic_ntk", 3000), ("rope_longrope", 4090)],
)
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_length_scheduled_keys_rotated_once_agree_with_rotating_both(
    name: str, start: int, backend: str
) -> None:
    """A schedule that picks frequencies by the call's length: keys rotated once at
    positions past the switch (dynamic NTK past 2048, LongRoPE's long factors past
    4096), read by queries that are not the newest keys, agree with the call that
    rotates both; the queries' length counts the keys' positions too (from the queries
    alone: off by 0.22 for dynamic NTK and 2.4 for LongRoPE)."""
    d = head_dim_for(name, 16)
    pe = generated_class(name)(heads=4, head_dim=d).double()
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 2, d, generator=generator, dtype=torch.float64) * 3
    k, v = (torch.randn(1, 2, 8, d, generator=generator, dtype=torch.float64) * 3 for _ in "kv")
    keys = torch.arange(start, start + 8)
    queries = keys[1:3]  # before the newest keys: their own length is below the switch
    positions = {"q_positions": queries, "k_positions": keys}
    both = pe(q, k, v, backend=backend, **positions)
    once = pe(q, pe.rotate_keys(k, keys), v, backend=backend, keys_rotated=True, **positions)
    torch.testing.assert_close(once, both, rtol=1e-10, atol=1e-10)


#: a switch at length 24 (each spec's own at 2048 or 4096), so that short loops cross it
SHORT_SWITCH = {
    "rope_dynamic_ntk": ("original_max_positions: 2048}", "original_max_positions: 24}"),
    "rope_longrope": ("original_max_positions: 4096\n", "original_max_positions: 24\n"),
}


@pytest.mark.parametrize(
    ("name", "builds"),
    [
        # one table for every length up to the switch; past it each call computes its
        # own: rotate at 5 + 15 lengths, rotate_keys and the step at 25, 30, 35 and 25
        ("rope_dynamic_ntk", 1 + 5 + 15 + 2 * 4),
        # one table for the short factors and one for the long, rebuilt on each crossing
        ("rope_longrope", 4),
    ],
)
def test_length_scheduled_tables_are_kept_per_regime_of_lengths(
    name: str, builds: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At default positions a schedule by length reads a float32 table of cos and sin
    kept for the lengths that share its frequencies (dynamic NTK up to original_max;
    LongRoPE's short factors up to it and its long ones past it): a decoding loop builds
    it when it crosses the switch, not every step. Every call, in rotate and in a decode
    step over keys rotated once, equals the float64 per-call schedule (which
    test_rope_scaling checks against Hugging Face), across the switch and back."""
    cls = spec_variant(name, SHORT_SWITCH[name], name=f"{name}_switch_24")
    d = head_dim_for(name, 16)
    torch.manual_seed(0)
    pe = cls(heads=2, head_dim=d)
    oracle = copy.deepcopy(pe).double()
    made = spy_calls(
        monkeypatch,
        [sys.modules[cls.__module__]],
        "_rotary_cos_sin",
        lambda positions, rotary_dim, dtype=torch.float32, length=None: dtype,
    )
    generator = torch.Generator().manual_seed(3)
    lengths = [*range(10, 30), 12, *range(20, 40)]  # up past 24, back below, up again
    for length in lengths:
        k = torch.randn(1, 2, length, d, generator=generator)
        q, v = k[:, :, -1:] * 2, k.flip(2)
        got_q, got_k = pe.rotate(q, k)
        want_q, want_k = oracle.rotate(q.double(), k.double())
        torch.testing.assert_close(got_q, want_q.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_k, want_k.float(), rtol=1e-5, atol=1e-5)
        if length % 5 == 0:
            step = pe(q, pe.rotate_keys(k), v, keys_rotated=True)
            want = oracle(q.double(), k.double(), v.double(), backend="eager")
            torch.testing.assert_close(step, want.float(), rtol=1e-5, atol=1e-5)
    assert made.count(torch.float32) == builds  # the oracle's float64 calls aside


@pytest.mark.parametrize("name", spec_names())
def test_a_decode_loop_reads_no_value_back_from_the_device(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decoding loop at default positions (one key more each step, over a cache of
    keys rotated once) reads no tensor's value back into Python for any encoding, with
    the CPU-only bias floor (one host read to skip it) and the CPU's values kept
    outside a ``parameters_frozen`` block (FIRE reads its threshold once for those)
    switched off as on a GPU: rows, spans and ranges of default positions are known on
    the host. Comparisons of kept values with the parameters (``torch.equal``) are not
    such reads."""
    set_runtime(monkeypatch, "BIAS_FLOOR_DEVICES", set())
    set_runtime(monkeypatch, "KEPT_WITHOUT_SYNC_DEVICES", set())
    d = head_dim_for(name, 16)
    pe = generated_class(name)(heads=4, head_dim=d).eval()
    generator = torch.Generator().manual_seed(5)
    k, v = (torch.randn(1, 2, 80, d, generator=generator) for _ in "kv")
    cache = pe.rotate_keys(k)
    reads = HostReads()
    with torch.no_grad():
        for m in range(60, 80):
            q = torch.randn(1, 4, 1, d, generator=generator)
            with reads:
                pe(q, cache[:, :, :m], v[:, :, :m], keys_rotated=True)
    assert reads.count == 0


def test_xpos_keeps_its_scaled_tables_for_a_cache_of_rotated_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """xPos scales cos and sin by zeta^(n / scale_base) for queries and divides keys by
    it, about position 0 for a cache of rotated keys. At default positions those scaled
    tables are kept per side: a decoding loop builds them as the plain cache grows, not
    every step, and never past the factors' reach (scale_base 8 reaches 408 positions
    from 0, all finite). Every step equals the float64 per-call factors."""
    cls = spec_variant("rope_xpos", ("scale_base: 512}", "scale_base: 8}"), name="xpos_base_8")
    torch.manual_seed(0)
    pe = cls(heads=2, head_dim=16)
    oracle = copy.deepcopy(pe).double()
    module = sys.modules[cls.__module__]
    assert module._xpos_reach() == 408  # 64 / (ln(1 / zeta_0) / 8), zeta_0 = 0.4 / 1.4
    scaled = spy_calls(
        monkeypatch,
        [module],
        "_xpos_scale",
        lambda positions, reference, rotary_dim, dtype: (positions.numel(), dtype),
    )
    generator = torch.Generator().manual_seed(6)
    k, v = (torch.randn(1, 2, 409, 16, generator=generator) for _ in "kv")
    cache = pe.rotate_keys(k)  # keys 0 .. 408, divided by their factors
    for m in [*range(20, 80), 300, 409]:
        q = torch.randn(1, 2, 1, 16, generator=generator)
        with torch.no_grad():
            step = pe(q, cache[:, :, :m], v[:, :, :m], keys_rotated=True)
        want = oracle(q.double(), k[:, :, :m].double(), v[:, :, :m].double(), backend="eager")
        torch.testing.assert_close(step, want.float(), rtol=1e-4, atol=1e-5)
    builds = [count for count, dtype in scaled if dtype == torch.float32]
    # keys: once for 409; queries: 64, 128 at 65 keys, 300 at 300 (twice 128 falls
    # short), then 409 (twice 300 capped at the reach)
    assert builds == [409, 64, 128, 300, 409]
    assert all(bool(table.isfinite().all()) for pair in pe._xpos_tables.values() for table in pair)


def test_host_reads_tells_device_data_from_host_data() -> None:
    """The helper behind the tests above: reads of device data count (a factory's
    tensor, and what is computed from it), reads of tensors made from Python values
    do not; with ``comparisons``, ``torch.equal`` of device data counts too."""
    device_data = torch.arange(4)
    with HostReads(comparisons=True) as reads:
        device_data.tolist()
        int(device_data[0])
        torch.tensor([1, 2]).tolist()
        (torch.tensor([3]) + 1).tolist()
        bool((torch.tensor([3]) + device_data[:1]).all())
        torch.equal(device_data, torch.tensor([0, 1, 2, 3]))
        torch.equal(torch.tensor([1]), torch.tensor([1]))
    assert reads.count == 4


@pytest.mark.parametrize("name", ["nope", "alibi", "deberta"])
def test_positions_equal_to_the_defaults_are_told_by_comparing_them_on_the_cpu(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU, positions given that are exactly the defaults ([N] or [batch, N]
    queries at M - N .. M - 1, keys 0 .. M - 1, as Hugging Face passes them each step)
    are told by one comparison each (``torch.equal`` with a kept range), without the
    general test's dozen small operations; so are positions of one row each that are
    not (shifted, in another order), by one read of their bounds and two comparisons
    (``_defaults_told_by_ranges``); batched shifted ones, which the bounds cannot tell
    for a shift-invariant encoding, still get the general test. The verdicts are the
    definition's, and the outputs agree with eager. (The CPU's bias floor, one read of
    its own, is off, and DeBERTa's kept projections are held by ``parameters_frozen``,
    not compared with its parameters.)"""
    set_runtime(monkeypatch, "BIAS_FLOOR_DEVICES", set())
    d = head_dim_for(name, 16)
    pe = generated_class(name)(heads=4, head_dim=d).eval()
    general = spy_calls(monkeypatch, runtime_modules(pe), "_default_flag", lambda *_: None)
    generator = torch.Generator().manual_seed(8)
    k, v = (torch.randn(2, 2, 30, d, generator=generator) for _ in "kv")
    q = torch.randn(2, 4, 3, d, generator=generator)
    keys = torch.arange(30)
    shifted = int(pe.shift_invariant)  # the general test finds the defaults shifted
    cases = [  # (q_positions, k_positions, general tests, reads where they are default)
        (keys[-3:], keys, 0, 2),  # the defaults
        (keys[-3:].expand(2, 3).clone(), keys.expand(2, 30).clone(), 0, 2),  # per batch row
        # shifted: the queries' comparison, the bounds, two comparisons with the shift
        (keys[-3:] + 5, keys + 5, 0, 4 if shifted else None),
        # batched and shifted: the general test (ruled out by the bounds where no shift
        # is allowed)
        ((keys[-3:] + 5).expand(2, 3).clone(), (keys + 5).expand(2, 30).clone(), shifted, None),
        (keys[-3:].flip(0), keys, 0, None),  # queries in another order: the comparisons
    ]
    with torch.no_grad(), parameters_frozen(pe):
        for q_positions, k_positions, general_tests, default_reads in cases:
            general.clear()
            given = {"q_positions": q_positions, "k_positions": k_positions}
            with HostReads(comparisons=True) as reads:
                out = pe(q, k, v, causal=True, **given)
            assert len(general) == general_tests
            # both comparisons for the defaults; else the queries' fails and the bounds
            # and comparisons (or the general test) follow, each a read on the CPU only:
            # on a GPU, where the comparisons are off, the general test reads once; other
            # positions then take the explicit-position paths, which read on their own
            if default_reads is not None:
                assert reads.count == default_reads
            oracle = pe(q, k, v, causal=True, backend="eager", **given)
            torch.testing.assert_close(out, oracle, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["nope", "rope", "deberta", "shaw"])
@pytest.mark.parametrize("shift", [0, 7])
def test_explicit_positions_cost_one_read_per_call(
    name: str, shift: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Positions given explicitly, as Hugging Face's position ids are every step, are
    checked in eager mode: their values (ValueError outside [0, 2^53 - 1]) and whether
    they are the defaults (shifted by a constant where only differences count), which
    picks the default paths. Both come from one read of the device per call, where
    each check read it on its own; bad values still raise, naming the argument. The
    verdict is kept for the same tensors while unchanged (``POSITION_VERDICTS``: the
    layers of a model given one positions tensor read it once), not for inference
    tensors, which count no version. (The CPU's exact comparison with the defaults and
    its rotation tables read at explicit positions, cheap reads there, are off here, as
    on a GPU.)"""
    set_runtime(monkeypatch, "BIAS_FLOOR_DEVICES", set())
    set_runtime(monkeypatch, "EXACT_DEFAULT_DEVICES", set())
    set_runtime(monkeypatch, "EXPLICIT_TABLE_DEVICES", set())
    d = head_dim_for(name, 16)
    pe = generated_class(name)(heads=4, head_dim=d).eval()
    generator = torch.Generator().manual_seed(7)
    k, v = (torch.randn(1, 2, 40, d, generator=generator) for _ in "kv")
    q = torch.randn(1, 4, 1, d, generator=generator)
    positions = torch.arange(40) + shift
    cache = pe.rotate_keys(k, positions)
    step = {"q_positions": positions[-1:], "k_positions": positions, "keys_rotated": True}
    with torch.no_grad():
        want = pe(q, cache, v, backend="eager", **step)
        fresh = dict(step, q_positions=positions[-1:].clone(), k_positions=positions.clone())
        with HostReads() as reads:
            got = pe(q, cache, v, **fresh)
        assert reads.count == 1
        with HostReads() as again:  # the same tensors, unchanged: read once
            repeated = pe(q, cache, v, **fresh)
        assert again.count == 0
        torch.testing.assert_close(repeated, got, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for argument in ("q_positions", "k_positions"):
        bad = dict(step, **{argument: step[argument] - 100})
        with pytest.raises(ValueError, match=f"{argument} must lie in"):
            pe(q, cache, v, **bad)
        fresh[argument].sub_(100)  # an edit in place moves the version: read again
        with pytest.raises(ValueError, match=f"{argument} must lie in"):
            pe(q, cache, v, **fresh)
        fresh[argument].add_(100)
    with torch.inference_mode():
        held = dict(step, q_positions=positions[-1:].clone(), k_positions=positions.clone())
        for _ in range(2):
            with HostReads() as reads:
                pe(q, cache, v, **held)
            assert reads.count == 1  # no version counter: nothing kept


def test_a_position_verdict_dies_with_its_tensor() -> None:
    """Verdicts on positions are keyed by the tensor object: a tensor that takes a dead
    one's id gets no verdict of the dead one's (checked by moving a verdict under
    another tensor's id, as id reuse would), nor one after an edit in place; and in a
    loop where new positions may take freed ids, every call matches the eager oracle."""
    verdicts = importlib.import_module("generated._tensor_verdicts").TensorVerdicts()
    first, second = torch.arange(3), torch.arange(3)
    verdicts.put(("default",), (first,), True)
    assert verdicts.get(("default",), (first,)) is True
    stamps, verdict = verdicts._kept.pop(("default", id(first)))
    verdicts._kept[("default", id(second))] = (stamps, verdict)  # as if second took the id
    assert verdicts.get(("default",), (second,)) is None
    verdicts.put(("default",), (second,), True)
    second.add_(1)
    assert verdicts.get(("default",), (second,)) is None

    pe = generated_class("alibi")(heads=4, head_dim=16).eval()
    generator = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 4, 40, 16, generator=generator) for _ in "qkv")
    with torch.no_grad():
        for _ in range(10):
            positions = torch.arange(40)  # the defaults: a kept verdict of True
            pe(q, k, v, q_positions=positions, k_positions=positions)
            del positions
            spread = torch.arange(40) * 3  # not the defaults; may take the freed id
            got = pe(q, k, v, q_positions=spread, k_positions=spread)
            want = pe(
                q, k, v, q_positions=spread.clone(), k_positions=spread.clone(), backend="eager"
            )
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class _KeyCounts:
    """The key counts of the attention calls the sdpa backend makes for ``pe``: those of
    ``scaled_dot_product`` and of ``grouped_query_attention`` (the CPU's decode matmuls)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, pe: torch.nn.Module) -> None:
        modules = runtime_modules(pe)
        self._lists = [
            spy_calls(monkeypatch, modules, name, lambda q, k, *_, **__: k.shape[2])
            for name in ("scaled_dot_product", "grouped_query_attention")
        ]

    def taken(self) -> list[int]:
        """The counts since the last call, and forget them."""
        counts = [count for calls in self._lists for count in calls]
        for calls in self._lists:
            calls.clear()
        return counts


WINDOWED = ["nope", "rope", "alibi", "t5", "kerple_power", "tupe_a"]


@pytest.mark.parametrize("name", WINDOWED)
@pytest.mark.parametrize("causal", [False, True])
def test_a_windowed_decode_step_reads_only_the_keys_in_its_window(
    name: str, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One query at the default position M - 1 with a sliding window of W < M keys: the
    sdpa backend attends the last W keys alone, with no mask (a bias of j - i reads
    them as keys 0 .. W - 1), and agrees with the eager oracle, which masks the rest.
    A bias that is not one of j - i alone (TUPE's untied term) keeps every key."""
    d = head_dim_for(name, 8)
    pe = generated_class(name)(heads=4, head_dim=d).double().eval()
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 1, d, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 12, d, generator=generator, dtype=torch.float64) for _ in "kv")
    cache = pe.rotate_keys(k)
    counts = _KeyCounts(monkeypatch, pe)
    for window in (1, 5, 11):
        step = pe(q, cache, v, window=window, causal=causal, keys_rotated=True, backend="sdpa")
        narrowed = counts.taken()
        oracle = pe(q, k, v, window=window, causal=causal, backend="eager")
        torch.testing.assert_close(step, oracle, rtol=1e-10, atol=1e-12)
        assert narrowed == ([12] if name == "tupe_a" else [window])
    wide = pe(q, cache, v, keys_rotated=True, backend="sdpa")
    assert not torch.allclose(step, wide)  # the window mattered


@pytest.mark.parametrize("name", ["alibi", "t5", "kerple_power", "rope"])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_decode_step_with_an_attn_mask_keeps_the_per_distance_row(
    name: str, kind: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One query with a padding mask per batch row (bool or additive): a bias of j - i
    stays the query's row of its per-distance vector, joined to the mask, rather than a
    bias made per (query, key) pair; it agrees with the float64 eager oracle, also where
    a window narrows the keys, and a batch row whose every key is masked gives zeros.
    float32 takes the CPU's decode matmuls, float64 SDPA."""
    d = head_dim_for(name, 8)
    pe = generated_class(name)(heads=4, head_dim=d).double().eval()
    generator = torch.Generator().manual_seed(6)
    q = torch.randn(3, 4, 1, d, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(3, 2, 10, d, generator=generator, dtype=torch.float64) for _ in "kv")
    keep = torch.ones(3, 1, 1, 10, dtype=torch.bool)
    keep[0, ..., :4] = False  # left padding
    keep[2] = False  # a row with nothing to read
    mask = (
        keep
        if kind == "bool"
        else torch.zeros(3, 1, 1, 10, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    )
    oracles = [pe(q, k, v, attn_mask=mask, window=w, backend="eager") for w in (None, 7)]
    pe = pe.to(dtype)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    mask = mask if kind == "bool" else mask.to(dtype)
    by_pair = spy_method(monkeypatch, type(pe), "_sdpa_bias", lambda *args, **_: None)
    cache = pe.rotate_keys(k)
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    for window, oracle in zip((None, 7), oracles, strict=True):
        step = pe(q, cache, v, attn_mask=mask, window=window, keys_rotated=True, backend="sdpa")
        torch.testing.assert_close(step.double(), oracle, rtol=tolerance, atol=tolerance)
        assert (step[2] == 0).all()
    assert by_pair == []


@pytest.mark.parametrize("name", ["rope", "rope_gptj", "rope_partial", "rope_yarn"])
def test_rotations_at_explicit_positions_read_the_table_on_the_cpu(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU, cos and sin at explicit positions ([N] or [batch, N]) are rows of the
    float32 table of default positions, grown to cover them, rather than angles formed
    afresh: the same rotation, within float32 rounding of the formula (the table's rows
    are formed by it); positions past ``EXPLICIT_TABLE_MAX_POSITIONS`` and float64
    inputs are computed. A positions tensor's reach is read once while unchanged."""
    pe = generated_class(name)(heads=2, head_dim=16).eval()
    computed = spy_method(monkeypatch, type(pe), "_cos_sin_at", lambda positions, *_: None)
    generator = torch.Generator().manual_seed(9)
    k = torch.randn(2, 2, 3, 16, generator=generator)
    limit = runtime_value("EXPLICIT_TABLE_MAX_POSITIONS", pe)
    cases = [
        (torch.tensor([5, 0, 70]), 0),  # past the table's first size: it grows
        (torch.tensor([[3, 4, 5], [900, 901, 902]]), 0),  # per batch row
        (torch.tensor([2, limit, 7]), 1),  # past the limit: computed
    ]
    with torch.no_grad():
        for positions, computed_calls in cases:
            computed.clear()
            got = pe.rotate_keys(k, positions)
            assert len(computed) == computed_calls
            computed.clear()
            set_runtime(monkeypatch, "EXPLICIT_TABLE_DEVICES", set())
            want = pe.rotate_keys(k, positions)  # the formula at the positions
            set_runtime(monkeypatch, "EXPLICIT_TABLE_DEVICES", {"cpu"})
            assert len(computed) == 1
            torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        computed.clear()
        pe.double().rotate_keys(k.double(), cases[0][0])  # float64: computed
        assert len(computed) == 1
    pe.float()
    reads = {}
    for layers in (1, 3):  # one model's layers, one positions tensor
        positions = torch.tensor([4, 9])
        with HostReads() as counted:
            for _ in range(layers):
                pe.rotate_keys(k[:, :, :2], positions)
        reads[layers] = counted.count
    assert reads[3] == reads[1]


@pytest.mark.parametrize("name", ["alibi", "rope", "tupe_a"])
def test_a_write_that_moves_no_version_counter_is_seen_on_the_cpu(name: str) -> None:
    """Positions and masks edited through ``.data`` (as a NumPy array sharing their
    memory would be) move no version counter: the verdicts kept on them are checked
    against a copy of their values on the CPU, so every call gives what fresh tensors
    of the same values give, and bad values still raise ValueError."""
    d = head_dim_for(name, 16)
    pe = generated_class(name)(heads=4, head_dim=d).eval()
    generator = torch.Generator().manual_seed(9)
    q = torch.randn(1, 4, 5, d, generator=generator)
    k, v = (torch.randn(1, 4, 7, d, generator=generator) for _ in "kv")
    k_positions, q_positions = torch.arange(7), torch.arange(2, 7)
    with torch.no_grad():
        pe(q, k, v, k_positions=k_positions, q_positions=q_positions)  # the defaults, kept
        for values in ([0, 2, 4, 6, 8, 10, 12], [0, 1, 2, 3, 4, 5, 300]):
            k_positions.data.copy_(torch.tensor(values))  # the version stays put
            got = pe(q, k, v, k_positions=k_positions, q_positions=q_positions)
            want = pe(q, k, v, k_positions=k_positions.clone(), q_positions=q_positions.clone())
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            eager = pe(
                q,
                k,
                v,
                k_positions=torch.tensor(values),
                backend="eager",
                q_positions=q_positions.clone(),
            )
            torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
        k_positions.data[-1] = -3
        with pytest.raises(ValueError, match="k_positions must lie in"):
            pe(q, k, v, k_positions=k_positions, q_positions=q_positions)
        k_positions.data = torch.arange(7)  # new data: its pointer is in the stamp
        torch.testing.assert_close(
            pe(q, k, v, k_positions=k_positions, q_positions=q_positions),
            pe(q, k, v),
            rtol=0,
            atol=0,
        )
        mask = torch.ones(1, 1, 5, 7, dtype=torch.bool)  # a left-padded row, then not
        mask[..., :2] = False
        padded = torch.cat([torch.zeros(2, dtype=torch.long), torch.arange(5)])
        pe(q, k, v, k_positions=padded, q_positions=padded[2:], attn_mask=mask)
        mask.data.fill_(True)
        got = pe(q, k, v, k_positions=padded, q_positions=padded[2:], attn_mask=mask)
        want = pe(
            q,
            k,
            v,
            k_positions=padded.clone(),
            q_positions=padded[2:].clone(),
            attn_mask=mask.clone(),
            backend="eager",
        )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_verdicts_keep_no_copy_of_a_large_tensor_and_trust_versions_off_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the CPU a verdict copies its tensors' values, so none is kept on a tensor
    above ``VERDICT_SNAPSHOT_MAX_ELEMENTS``; on a device whose values are not compared
    (CUDA: the comparison would be a sync), a kept verdict trusts the version counter
    and still sees new data put under the same tensor (``t.data = other``)."""
    runtime = importlib.import_module("generated._tensor_verdicts")
    verdicts = runtime.TensorVerdicts()
    monkeypatch.setattr(runtime, "VERDICT_SNAPSHOT_MAX_ELEMENTS", 4)
    small, large = torch.arange(4), torch.arange(5)
    verdicts.put(("default",), (small,), True)
    verdicts.put(("default",), (large,), True)
    assert verdicts.get(("default",), (small,)) is True
    assert verdicts.get(("default",), (large,)) is None
    small.data[0] = 7
    assert verdicts.get(("default",), (small,)) is None
    monkeypatch.setattr(runtime, "VALUE_CHECKED_VERDICT_DEVICES", set())
    verdicts.put(("default",), (large,), True)
    large.data[0] = 7  # unseen: only the version counter speaks for the values
    assert verdicts.get(("default",), (large,)) is True
    large.data = torch.arange(5)
    assert verdicts.get(("default",), (large,)) is None


def test_a_verdict_on_a_view_holds_for_the_same_slice_taken_again() -> None:
    """A view is known by its base and its place in it: the same slice taken anew (a
    mask cut to the keys in each layer) finds the verdict, another slice of the base
    does not, and an edit in place of the base (through any view) drops it."""
    verdicts = importlib.import_module("generated._tensor_verdicts").TensorVerdicts()
    mask = torch.ones(2, 1, 5, 9, dtype=torch.bool)
    verdicts.put(("live",), (mask[..., :7],), True)
    assert verdicts.get(("live",), (mask[..., :7],)) is True
    assert verdicts.get(("live",), (mask[..., :6],)) is None
    assert verdicts.get(("live",), (mask[..., 1:8],)) is None
    assert verdicts.get(("live",), (mask[..., :7].view(torch.uint8),)) is None  # another dtype
    mask[0, 0, 0, 0] = False
    assert verdicts.get(("live",), (mask[..., :7],)) is None


@pytest.mark.parametrize("name", ["alibi", "alibi_learned", "kerple_power"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_whose_mask_hides_the_newest_keys_reads_the_rest_exactly(
    name: str, dtype: torch.dtype
) -> None:
    """One query at the default position M - 1 with an attn_mask hiding the newest 250
    of 300 keys (distance 0 among them): the floor under the bias sat under the entry
    at distance 0, which no key it reads has, and raised every key read to it (bf16
    0.8 off for ALiBi, 1.7 for KERPLE-power); a half-precision vector was shifted by
    that entry too. sdpa is as close to the float64 truth as eager is."""
    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=16)
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 1, 16, generator=generator)
    k, v = (torch.randn(1, 4, 300, 16, generator=generator) for _ in "kv")
    mask = torch.ones(1, 1, 1, 300, dtype=torch.bool)
    mask[..., -250:] = False
    with torch.no_grad():
        truth = copy.deepcopy(pe).double()(
            q.double(), k.double(), v.double(), attn_mask=mask, backend="eager"
        )
        inputs = (q.to(dtype), k.to(dtype), v.to(dtype))
        eager, sdpa = (
            pe.to(dtype)(*inputs, attn_mask=mask, backend=backend).double()
            for backend in ("eager", "sdpa")
        )
    eager_error = float((eager - truth).abs().max())
    tolerance = 1e-5 if dtype == torch.float32 else 4 * max(eager_error, 2**-8)
    assert float((sdpa - truth).abs().max()) <= tolerance, (eager_error, tolerance)
