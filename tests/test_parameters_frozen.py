"""``parameters_frozen``: inside the block, values kept from an encoding's parameters
(projected relative rows, TUPE's untied rows, FLOATER's trajectory) are compared with
the parameters once and then reused; outside it, every read compares them.

Each kept value is checked against a fresh module loaded with the same parameters, which
has nothing kept.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
from collections.abc import Callable

import pytest
import torch

from generated import parameters_frozen
from tests.conftest import HostReads, generated_class, runtime_modules, set_runtime, spy_calls

F64 = torch.float64
#: encodings that keep a value of their parameters across calls without gradients
KEEPING = [
    "deberta",
    "transformer_xl",
    "tupe_a",
    "floater",
    "fire",
    "kerple_power",
    "alibi_learned",
    "t5",
]
#: a parameter each kept value is made from (Transformer-XL's u and v are read afresh)
KEPT_FROM = {
    "deberta": "rel_embeddings.weight",
    "transformer_xl": "r_net.weight",
    "tupe_a": "position_embeddings.weight",
    "floater": "dynamics_out.weight",
    "fire": "fire_mlp.0.weight",  # the MLP's pieces
    "kerple_power": "r1",  # the bias per distance
    "alibi_learned": "slopes",
    "t5": "relative_attention_bias.weight",
}


def make(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return generated_class(name)(heads=4, head_dim=8).double().eval()


def reader(name: str) -> Callable[[torch.nn.Module, int], torch.Tensor]:
    """What reads ``name``'s kept value: FLOATER's embedding of a sequence of ``length``
    positions (its trajectory), for the others one decode query against ``length`` keys."""
    generator = torch.Generator().manual_seed(3)
    if name == "floater":
        x = torch.randn(1, 40, make(name).model_dim, generator=generator, dtype=F64)
        return lambda pe, length: pe.embed(x[:, :length])
    q = torch.randn(1, 4, 1, 8, generator=generator, dtype=F64)
    k, v = (torch.randn(1, 4, 40, 8, generator=generator, dtype=F64) for _ in "kv")
    return lambda pe, length: pe(q, k[:, :, :length], v[:, :, :length], backend="sdpa")


def fresh_copy(pe: torch.nn.Module, name: str) -> torch.nn.Module:
    """A new module holding pe's parameters now, with nothing kept."""
    fresh = make(name, seed=1)
    fresh.load_state_dict(pe.state_dict())
    return fresh


def count_comparisons(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    return spy_calls(monkeypatch, runtime_modules(), "parameters_equal", lambda pairs: len(pairs))


@pytest.mark.parametrize("name", KEEPING)
def test_a_frozen_block_compares_the_parameters_once(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop of reads on the CPU compares the parameters once at every read but the
    first (which keeps the value) outside the block, and only at its first read inside
    one (the values kept per distance, FIRE's pieces among them, are kept outside a
    block only where comparing costs no sync: ``_kept_without_sync``)."""
    pe, read = make(name), reader(name)
    comparisons = count_comparisons(monkeypatch)
    with torch.no_grad():
        outside = [read(pe, length) for length in range(30, 36)]
        assert len(comparisons) == 5
        with parameters_frozen(pe):
            inside = [read(pe, length) for length in range(30, 36)]
        assert len(comparisons) == 6
        fresh = fresh_copy(pe, name)
        for length, got, again in zip(range(30, 36), outside, inside, strict=True):
            want = read(fresh, length)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(again, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["deberta", "tupe_a"])
def test_a_frozen_decode_loop_reads_nothing_back(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the comparison a GPU makes (every parameter compared on the device, one flag
    read back: ``PARAMETERS_COMPARED_AT_ONCE``), a decode loop reads one value per step
    for its kept rows outside the block and none inside it."""
    set_runtime(monkeypatch, "PARAMETERS_COMPARED_AT_ONCE", {"cpu"})
    pe, read = make(name), reader(name)
    counts = []
    with torch.no_grad():
        read(pe, 20)  # keeps the rows
        for frozen in (False, True):
            with parameters_frozen(pe) if frozen else contextlib.nullcontext():
                read(pe, 20)  # the block's one comparison
                with HostReads() as reads:
                    for length in range(21, 30):
                        read(pe, length)
            counts.append(reads.count)
    assert counts == [9, 0]


@pytest.mark.parametrize("name", KEEPING)
def test_updates_version_counters_see_are_seen_inside_the_block(name: str) -> None:
    """An optimizer step (foreach, as torch's default), an in-place edit under no_grad
    and load_state_dict move version counters, so a frozen block still drops what it
    kept from the old values."""
    pe, read = make(name), reader(name)
    optimizer = torch.optim.SGD(pe.parameters(), lr=0.5, foreach=True)
    # a kept span vector may differ from one made for the call's own distances in the
    # last bit (vectorized and scalar paths of log and pow); stale values differ by far
    same = {"rtol": 1e-12, "atol": 1e-12}
    with parameters_frozen(pe):
        with torch.no_grad():
            before = read(pe, 30)
        read(pe, 30).square().sum().backward()  # with gradients: nothing kept
        optimizer.step()
        with torch.no_grad():
            stepped = read(pe, 30)
            torch.testing.assert_close(stepped, read(fresh_copy(pe, name), 30), **same)
            for parameter in pe.parameters():
                parameter.mul_(0.75)
            edited = read(pe, 30)
            torch.testing.assert_close(edited, read(fresh_copy(pe, name), 30), **same)
            pe.load_state_dict(make(name, seed=2).state_dict())
            loaded = read(pe, 30)
            torch.testing.assert_close(loaded, read(make(name, seed=2), 30), **same)
    assert not torch.allclose(before, stepped)
    assert not torch.allclose(stepped, edited)
    assert not torch.allclose(edited, loaded)


@pytest.mark.parametrize("name", KEEPING)
@pytest.mark.parametrize("optimizer_class", [torch.optim.AdamW, torch.optim.SGD])
def test_a_fused_optimizer_step_is_seen_inside_the_block(name: str, optimizer_class) -> None:
    """A fused step (``fused=True``; Hugging Face's default AdamW) writes the parameters
    without moving their version counters: the block still drops what it kept from the
    old values (it kept them, and went on reading them, before)."""
    pe, read = make(name), reader(name)
    optimizer = optimizer_class(pe.parameters(), lr=0.1, fused=True)
    versions = [parameter._version for parameter in pe.parameters()]
    with parameters_frozen(pe):
        with torch.no_grad():
            before = read(pe, 30)
        read(pe, 30).square().sum().backward()
        optimizer.step()
        assert [parameter._version for parameter in pe.parameters()] == versions
        with torch.no_grad():
            stepped = read(pe, 30)
            fresh = read(fresh_copy(pe, name), 30)
    torch.testing.assert_close(stepped, fresh, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(before, stepped)


@pytest.mark.parametrize("name", KEEPING)
def test_an_edit_through_data_is_the_blocks_promise(name: str) -> None:
    """An edit through ``.data`` moves no version counter: outside a block the
    comparison sees it; inside one, after the first read, the kept value stands (the
    caller promised no such edit) until the block ends; an edit made before the block
    is seen at its first read."""
    pe, read = make(name), reader(name)
    with torch.no_grad():
        kept = read(pe, 30)
        kept_from = pe.get_parameter(KEPT_FROM[name])
        with parameters_frozen(pe):
            assert torch.equal(read(pe, 30), kept)
            kept_from.data.mul_(0.75)
            assert torch.equal(read(pe, 30), kept)  # not compared again
        edited = read(fresh_copy(pe, name), 30)
        assert not torch.allclose(edited, kept)
        torch.testing.assert_close(read(pe, 30), edited, rtol=0, atol=0)
        kept_from.data.mul_(0.5)
        with parameters_frozen(pe):
            torch.testing.assert_close(read(pe, 30), read(fresh_copy(pe, name), 30), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["deberta", "transformer_xl", "tupe_a"])
def test_kept_rows_are_kept_per_dtype(name: str) -> None:
    """Rows projected for a float32 call are not read by a float64 one: its output is
    a fresh module's, to the last bit."""
    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=8).eval()
    fresh = copy.deepcopy(pe)
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 9, 8, generator=generator, dtype=F64) for _ in "qkv")
    with torch.no_grad():
        pe(q.float(), k.float(), v.float(), backend="sdpa")  # keeps float32 rows
        got = pe(q, k, v, backend="sdpa")
        assert got.dtype == F64
        torch.testing.assert_close(got, fresh(q, k, v, backend="sdpa"), rtol=0, atol=0)


@pytest.mark.parametrize("name", KEEPING)
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_made_inside_a_block_is_outside_it(name: str, how: str) -> None:
    """A copy (an EMA model, a checkpoint of the whole module) made inside a block
    leaves it: an edit through ``.data`` afterwards is seen. It carries none of the
    values kept across calls (its parameter snapshots)."""
    pe, read = make(name), reader(name)
    with torch.no_grad(), parameters_frozen(pe):
        read(pe, 30)
        assert pe._cache, "nothing kept: a vacuous case"
        copied = copy.deepcopy(pe) if how == "deepcopy" else pickle.loads(pickle.dumps(pe))
    assert copied._frozen_block is None and not copied._cache
    with torch.no_grad():
        before = read(copied, 30)
        copied.get_parameter(KEPT_FROM[name]).data.mul_(0.5)
        edited = read(copied, 30)
        assert not torch.allclose(edited, before)
        torch.testing.assert_close(edited, read(fresh_copy(copied, name), 30), rtol=0, atol=0)
    assert pe._cache, "the original keeps its values"


def test_blocks_nest_and_cover_every_encoding_of_a_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A block over a model marks each encoding inside it; an inner block over one of
    them compares once more and gives the outer block back on exit (whose next read
    compares once more)."""
    model = torch.nn.ModuleList([make("deberta"), torch.nn.Linear(2, 2), make("tupe_a")])
    read_deberta, read_tupe = reader("deberta"), reader("tupe_a")
    comparisons = count_comparisons(monkeypatch)
    with torch.no_grad():
        read_deberta(model[0], 30), read_tupe(model[2], 30)  # kept: no comparison
        with parameters_frozen(model):
            for _ in range(3):
                read_deberta(model[0], 30), read_tupe(model[2], 30)
            assert len(comparisons) == 2  # once each
            with model[0].parameters_frozen():
                read_deberta(model[0], 30), read_deberta(model[0], 30)
                assert len(comparisons) == 3
            for _ in range(2):
                read_deberta(model[0], 30), read_tupe(model[2], 30)
            assert len(comparisons) == 4  # the outer block's again: DeBERTa's once more
        assert model[0]._frozen_block is None and model[2]._frozen_block is None
        read_deberta(model[0], 30)
        assert len(comparisons) == 5


def test_a_block_ends_when_its_body_raises() -> None:
    pe = make("deberta")
    with pytest.raises(RuntimeError, match="body"), parameters_frozen(pe):
        raise RuntimeError("body")
    assert pe._frozen_block is None


@pytest.mark.parametrize(
    ("modules", "message"),
    [
        ((torch.nn.Linear(2, 2),), "holds no posgen encoding"),
        ((), "holds no posgen encoding"),
        ((make("deberta"), "model"), "got str as argument 1"),
    ],
)
def test_bad_arguments_are_refused(modules: tuple[object, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message), parameters_frozen(*modules):  # type: ignore[arg-type]
        pass


def test_module_parameters_lists_what_parameters_yields() -> None:
    """``module_parameters`` (the parameters that states and snapshots read) lists the
    parameters in ``Module.parameters()``'s order, each once: own before children's,
    depth first, a parameter shared by two children (tied weights) at its first place,
    and none for an empty slot."""
    from generated._parameter_snapshots import module_parameters

    shared = torch.nn.Parameter(torch.zeros(2))
    inner = torch.nn.Linear(2, 2)
    inner.tied = shared
    outer = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sequential(inner), torch.nn.ReLU())
    outer.extra = torch.nn.Linear(3, 1)
    outer.extra.tied = shared  # the same parameter again
    outer.register_parameter("empty", None)
    outer.own = torch.nn.Parameter(torch.ones(1))
    got = module_parameters(outer)
    assert [id(p) for p in got] == [id(p) for p in outer.parameters()]
    assert len(got) == 8  # own, 2 + 2 + shared in the linears, extra's 2
    pe = generated_class("deberta")()
    assert [id(p) for p in module_parameters(pe)] == [id(p) for p in pe.parameters()]


def test_cheap_values_are_kept_off_the_cpu_only_inside_a_block() -> None:
    """``_kept_without_sync`` keeps a value on the CPU, where comparing it with the
    parameters reads nothing back, and on another device only inside a
    ``parameters_frozen`` block (compared once there): outside one it gives None, so
    that a CUDA decode loop makes the value each step instead of a sync."""
    pe = make("kerple_power")
    made: list[int] = []

    def value() -> list[int]:
        made.append(1)
        return made

    elsewhere = torch.device("meta")  # any device but the CPU
    with torch.no_grad():
        assert pe._kept_without_sync(("probe",), elsewhere, value) is None
        assert made == []
        with parameters_frozen(pe):
            first = pe._kept_without_sync(("probe",), elsewhere, value)
            again = pe._kept_without_sync(("probe",), elsewhere, value)
        assert first is again is made and made == [1]
        on_cpu = pe._kept_without_sync(("probe",), torch.device("cpu"), value)
        assert on_cpu is made and made == [1, 1]
        assert pe._kept_without_sync(("probe",), torch.device("cpu"), value) is made
        assert made == [1, 1]
