"""Shared fixtures: the catalogue's generated classes, built once per session."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from posgen.codegen.inmemory import encoding_class, module_from_spec

# posgen check's tables wrap at the terminal's width: one width for every test, whatever
# the terminal (pytest-xdist's workers see 80 columns, a plain run falls back to 110)
os.environ["COLUMNS"] = "110"

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"
GENERATED = ROOT / "generated"
# the runtime's modules: templates/runtime/_NAME.py, each generated as generated/_NAME.py
RUNTIME_FILES = sorted(path.name for path in (ROOT / "templates" / "runtime").glob("_*.py"))


def spec_names() -> list[str]:
    """Every spec in the catalogue, sorted."""
    return sorted(path.stem for path in SPECS.glob("*.yaml"))


def generated_class(name: str) -> type[torch.nn.Module]:
    """The class exported by generated/<name>.py."""
    module = importlib.import_module(f"generated.{name}")
    (class_name,) = module.__all__
    return getattr(module, class_name)


@functools.cache
def head_dim_for(name: str, wanted: int) -> int:
    """``wanted``, or the spec's own head_dim where its rotation is sized for it (M-RoPE
    sections, LongRoPE factor lists: other widths raise ValueError by design)."""
    cls = generated_class(name)
    try:
        cls(head_dim=wanted)
    except ValueError:
        default = inspect.signature(cls.__init__).parameters["head_dim"].default
        assert isinstance(default, int)
        return default
    return wanted


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)


_VARIANTS = tempfile.TemporaryDirectory(prefix="posgen-variants-")


def spec_variant(
    base: str, *replacements: tuple[str, str], name: str | None = None
) -> type[torch.nn.Module]:
    """The class of ``specs/<base>.yaml`` with text replacements, built in memory.

    Each ``(old, new)`` replaces ``old``, which must occur in the spec, so a stale edit
    fails loudly; ``name`` renames the spec (and its module) when given.
    """
    text = (SPECS / f"{base}.yaml").read_text(encoding="utf-8")
    if name is not None:
        replacements = ((f"name: {base}\n", f"name: {name}\n"), *replacements)
    for old, new in replacements:
        assert old in text, old
        text = text.replace(old, new)
    path = Path(_VARIANTS.name) / f"{name or base}.yaml"
    path.write_text(text, encoding="utf-8")
    return encoding_class(module_from_spec(path))


SMALL_SPEC = """\
name: {name}
title: {title}
references: ["{reference}"]
defaults: {{heads: 2, head_dim: 8}}
scale: inv_sqrt_head_dim
terms:
  content_content: keep
  content_position: drop
  position_content: drop
  position_position: {position_position}
claims: {{{claims}}}
"""


def small_spec_text(
    name: str,
    claims: str = "",
    position_position: str = "drop",
    title: str = "No positional encoding",
    reference: str = "Kazemnejad et al. 2023, arXiv:2305.19466",
) -> str:
    """A spec of content plus at most a position-only term, 2 heads of width 8: NoPE by
    default; ``claims`` is the inside of the claims mapping ("unique: true")."""
    return SMALL_SPEC.format(
        name=name,
        claims=claims,
        position_position=position_position,
        title=title,
        reference=reference,
    )


def expr_bias_spec(
    folder: Path, name: str, expr: str, claims: str = "", heads: int = 2, params: str = "{}"
) -> Path:
    """``folder/name.yaml``: ``small_spec_text`` with the position-only bias ``expr`` of
    i and j (after the scale) and its ``params`` (a YAML mapping), and ``heads`` heads."""
    bias = f'{{bias: {{kind: expr, expr: "{expr}", params: {params}, placement: after_scale}}}}'
    text = small_spec_text(name, claims, bias, "an expression bias", "test")
    text = text.replace("{heads: 2,", f"{{heads: {heads},", 1)
    path = folder / f"{name}.yaml"
    path.write_text(text, encoding="utf-8")
    return path


# clips small enough that short sequences have keys past them on both sides
SMALL_CLIPS = {
    "shaw": ("max_distance: 16", "max_distance: 3"),
    "bert_relative_key": ("max_distance: 511", "max_distance: 4"),
    "bert_relative_key_query": ("max_distance: 511", "max_distance: 4"),
    "deberta": ("buckets: 256, max_distance: 512", "buckets: 8, max_distance: 12"),
}


@functools.cache
def small_clip_variant(name: str) -> type[torch.nn.Module]:
    """The catalogue's ``name`` (a key of ``SMALL_CLIPS``) with a small clip."""
    return spec_variant(name, SMALL_CLIPS[name], name=f"{name}_small_clip")


def small_clip_module(name: str, **options: int) -> torch.nn.Module:
    """A float64 ``small_clip_variant(name)`` with 4 heads of width 8 (DeBERTa's rows 16
    wide), seeded; Transformer-XL, which has no clip, as the catalogue has it (rows 16
    wide)."""
    torch.manual_seed(3)
    if name == "transformer_xl":
        return generated_class(name)(heads=4, head_dim=8, model_dim=16, **options).double()
    extra = {"model_dim": 16} if name == "deberta" else {}
    return small_clip_variant(name)(heads=4, head_dim=8, **extra, **options).double()


def cpu_memory_module() -> ModuleType:
    """benchmarks/cpu_memory.py, the CPU peak-memory measure the benchmarks report."""
    path = ROOT / "benchmarks" / "cpu_memory.py"
    spec = importlib.util.spec_from_file_location("cpu_memory", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sdpa_extra_memory(pe: torch.nn.Module, n: int, causal: bool, train: bool) -> int:
    """Bytes that ``pe``'s sdpa call on [1, heads, n, 16] inputs holds at its peak beyond
    plain SDPA's peak for the same call (its kernel's per-thread buffers included),
    each measured after a warm-up call, so that caches and buffers already exist;
    ``train``: forward and backward into q, k and v."""
    memory = cpu_memory_module()
    q, k, v = (torch.randn(1, pe.heads, n, 16, requires_grad=train) for _ in "qkv")

    def step(plain: bool) -> object:
        if plain:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        else:
            out = pe(q, k, v, causal=causal, backend="sdpa")
        return torch.autograd.grad(out.sum(), (q, k, v)) if train else out

    step(False), step(True)
    peak = memory.cpu_peak_extra_bytes(lambda: step(False))
    baseline = memory.cpu_peak_extra_bytes(lambda: step(True))
    assert peak is not None and baseline is not None
    return int(peak - baseline)


def from_hf_spec(config: dict[str, Any], folder: Path, name: str, *options: str) -> Path:
    """The spec file ``posgen from-hf`` writes (as ``folder/name.yaml``) for ``config``, a
    config.json as a dict, with the CLI ``options`` (``--layer 3``)."""
    import json

    from click.testing import CliRunner

    from posgen.cli import main

    config_file, out = folder / f"{name}.json", folder / f"{name}.yaml"
    config_file.write_text(json.dumps(config), encoding="utf-8")
    arguments = ["from-hf", str(config_file), "--name", name, "--out", str(out), *options]
    result = CliRunner().invoke(main, arguments)
    assert result.exit_code == 0, result.output
    return out


def from_hf_class(
    config: dict[str, Any], folder: Path, name: str, *options: str
) -> type[torch.nn.Module]:
    """The class of the module built from ``from_hf_spec(config, folder, name, *options)``."""
    return encoding_class(module_from_spec(from_hf_spec(config, folder, name, *options)))


def posgen_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention layers ``posgen.hf.use_posgen_attention`` routed through posgen."""
    return [module for module in model.modules() if hasattr(module, "posgen")]


def llama4_layer_and_module(
    layer: torch.nn.Module,
    pe: torch.nn.Module,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    freqs: torch.Tensor | None = None,
    **options: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Hugging Face's Llama4TextAttention ``layer`` on hidden [B, N, width] at
    ``positions`` with its 4-D additive ``mask`` and rotary ``freqs``, the posgen module
    ``pe`` between the same layer's projections, causal at those positions, with q and
    k through the layer's ``qk_norm`` where it has one), both [B, N, width], no grad."""
    batch, n = hidden.shape[:2]
    head_dim = layer.head_dim
    with torch.no_grad():
        expected, _ = layer(hidden, freqs, mask, cache_position=positions)
        q = layer.q_proj(hidden).view(batch, n, -1, head_dim)  # [B, N, H, D]
        k = layer.k_proj(hidden).view(batch, n, -1, head_dim)  # [B, N, H_kv, D]
        v = layer.v_proj(hidden).view(batch, n, -1, head_dim)
        if hasattr(layer, "qk_norm"):
            q, k = layer.qk_norm(q), layer.qk_norm(k)
        out = pe(
            q, k, v, causal=True, q_positions=positions, k_positions=positions,
            layout="bnhd", **options,
        )  # fmt: skip
        got = layer.o_proj(out.reshape(batch, n, -1))
    return expected, got


def cope_beside_x_transformers(
    heads: int, dim: int, max_pos: int = 16
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """x-transformers' CoPE (table drawn from N(0, 1)) and the generated cope module
    holding the same table, for the tests that compare the two; skips without
    x-transformers."""
    xt = pytest.importorskip("x_transformers.x_transformers")
    reference = xt.CoPE(dim=dim, heads=heads, max_pos=max_pos)
    with torch.no_grad():
        reference.pos_emb.normal_()
    pe = generated_class("cope")(heads=heads, head_dim=dim)
    with torch.no_grad():
        pe.cope_positions.copy_(reference.pos_emb)
    return reference, pe


def run_backend(
    pe: torch.nn.Module, inputs: dict[str, torch.Tensor], backend: str, **options: object
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The output for ``inputs`` (q, k, v) on ``backend`` and the gradients of a fixed
    weighting of it into q, k, v and the module's parameters (those it reaches)."""
    leaves = {key: value.clone().requires_grad_() for key, value in inputs.items()}
    pe.zero_grad()
    out = pe(leaves["q"], leaves["k"], leaves["v"], backend=backend, **options)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    grads = [leaves[key].grad for key in ("q", "k", "v")]
    grads += [p.grad.clone() for p in pe.parameters() if p.grad is not None]
    return out.detach(), grads


def assert_sdpa_matches_eager(
    pe: torch.nn.Module, n: int, m: int, kv_heads: int, batch: int = 2, **options: object
) -> None:
    """Outputs and gradients (into q, k, v and the parameters) of the sdpa backend equal
    the eager oracle's, float64, with 4 query heads of width 8."""
    generator = torch.Generator().manual_seed(2)
    shapes = {
        "q": (batch, 4, n, 8),
        "k": (batch, kv_heads, m, 8),
        "v": (batch, kv_heads, m, 8),
    }
    inputs = {
        key: torch.randn(*shape, generator=generator, dtype=torch.float64)
        for key, shape in shapes.items()
    }
    eager, eager_grads = run_backend(pe, inputs, "eager", **options)
    sdpa, sdpa_grads = run_backend(pe, inputs, "sdpa", **options)
    torch.testing.assert_close(sdpa, eager, rtol=1e-10, atol=1e-12)
    assert len(sdpa_grads) == len(eager_grads)
    for got, want in zip(sdpa_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def assert_backends_agree_on_a_grouped_call(
    pe: torch.nn.Module, causal: bool, explicit: bool
) -> list[torch.Tensor]:
    """sdpa, flex (its unfused reference on the CPU; not for a value-side term, which it
    refuses) and auto against the eager oracle, float32, 4 query heads over 2 key-value
    heads of the module's widths, 12 queries against 12 keys (default positions 0 .. 11,
    or explicit ones reaching 45): outputs and the gradients into q, k, v and the
    parameters. Returns eager's gradients."""
    width = pe.head_dim
    value_width = getattr(pe, "value_dim", None) or width
    inputs = {"q": torch.randn(2, 4, 12, width), "k": torch.randn(2, 2, 12, width)}
    inputs["v"] = torch.randn(2, 2, 12, value_width)
    options: dict[str, object] = {"causal": causal}
    if explicit:
        keys = torch.tensor([0, 2, 3, 7, 8, 11, 20, 21, 30, 33, 40, 45])
        options.update(q_positions=keys, k_positions=keys)
    eager, eager_grads = run_backend(pe, inputs, "eager", **options)
    for backend in ("sdpa", "auto") if pe.has_value_term else ("sdpa", "flex", "auto"):
        out, grads = run_backend(pe, inputs, backend, **options)
        torch.testing.assert_close(out, eager, rtol=2e-5, atol=2e-5)
        assert len(grads) == len(eager_grads)
        for got, want in zip(grads, eager_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    return eager_grads


def assert_sdpa_matches_eager_without_trained_terms(
    pe: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """For causal and not: the sdpa output and its gradients into q and k (the tensors
    that require them) equal the eager oracle's, float64, and so does a call without
    autograd."""
    for causal in (False, True):
        want = pe(q, k, v, causal=causal, backend="eager")
        got = pe(q, k, v, causal=causal, backend="sdpa")
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        want_grads = torch.autograd.grad(want.square().sum(), (q, k))
        got_grads = torch.autograd.grad(got.square().sum(), (q, k))
        for a, b in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
        with torch.no_grad():
            inference = pe(q, k, v, causal=causal, backend="sdpa")
        torch.testing.assert_close(inference, want.detach(), rtol=1e-10, atol=1e-12)


def runtime_modules(pe: torch.nn.Module | None = None) -> list[ModuleType]:
    """The modules whose globals ``pe``'s runtime reads: a variant built in memory
    inlines the whole runtime into its own module; the generated modules (and no
    ``pe``) read generated/_NAME.py, one module per file of templates/runtime/."""
    if pe is not None:
        own = sys.modules[type(pe)._attend.__module__]
        if own.__name__ != "generated._attention":
            return [own]
    return [importlib.import_module(f"generated.{name[:-3]}") for name in RUNTIME_FILES]


def set_runtime(
    monkeypatch: pytest.MonkeyPatch, name: str, value: Any, pe: torch.nn.Module | None = None
) -> None:
    """Set the runtime global ``name`` for the test in every module of ``pe``'s runtime
    that binds it: the one defining it and any importing it (a setting such as
    ``SDPA_QUERY_CHUNK`` is read only where it is defined; ``TRITON_CACHE`` is shared)."""
    modules = [module for module in runtime_modules(pe) if name in vars(module)]
    assert modules, f"no runtime module binds {name}"
    for module in modules:
        monkeypatch.setattr(module, name, value)


#: runtime settings naming the devices a route serves, as a set of device types or a dict
#: keyed by device type: ``cuda_routes`` gives the CPU what CUDA has in each
DEVICE_ROUTES = (
    "BAND_VIEW_DEVICES",
    "BIAS_FLOOR_DEVICES",
    "CHUNKED_FLASH_DEVICES",
    "CLIPPED_BIAS_FLEX_DEVICES",
    "COUNTED_POSITION_DEVICES",
    "DIRECTIONAL_BIAS_DEVICES",
    "DISTANCE_VECTOR_DEVICES",
    "EXACT_DEFAULT_DEVICES",
    "EXPLICIT_TABLE_DEVICES",
    "FLIPPED_ROTATION_MAX_ELEMENTS",
    "FOLDED_BIAS_DEVICES",
    "FUSED_DISTANCE_TRAINED_DEVICES",
    "FUSED_RELATIVE_DEVICES",
    "FUSED_RELATIVE_TRAINED_DEVICES",
    "GROUPED_QUERY_DEVICES",
    "KEPT_WITHOUT_SYNC_DEVICES",
    "KEY_SIDE_CHUNK_BYTES",
    "PARAMETERS_COMPARED_AT_ONCE",
    "RECOMPUTED_MASK_DEVICES",
    "RELATIVE_CHUNK_DEVICES",
    "ROLLED_ROTATION_MAX_ELEMENTS",
    "ROTATION_CHUNK_BYTES",
    "SDPA_LONG_QUERY_CHUNK",
    "SDPA_MASK_CHUNK_BYTES",
    "SDPA_QUERY_CHUNK",
    "SKEWED_RELATIVE_DEVICES",
    "TRAINED_MASK_DEVICES",
    "VALUE_CHECKED_VERDICT_DEVICES",
)
#: device settings ``cuda_routes`` leaves as they are: the Triton kernels (the CPU runs
#: them interpreted, slowly; their own tests list the CPU) and a choice made only under
#: torch.compile
KERNEL_ROUTES = (
    "EAGER_ROTATION_UNDER_COMPILE",
    "FUSED_DISTANCE_DEVICES",
    "FUSED_DISTANCE_ROUTES",
    "FUSED_ROTATION_DEVICES",
)


def cuda_routes(monkeypatch: pytest.MonkeyPatch, pe: torch.nn.Module | None = None) -> None:
    """Set every setting of DEVICE_ROUTES so that the CPU takes CUDA's routes for the
    test: a set lists "cpu" where it lists "cuda", a dict keyed by device gives "cpu"
    CUDA's entry (or none). So the branches a GPU takes run in the CPU suite, but for
    the Triton kernels and the checks of what the device itself can do (the CPU flash
    kernels called directly, float64)."""
    for name in DEVICE_ROUTES:
        value = runtime_value(name, pe)
        if isinstance(value, dict):
            routed: Any = {device: v for device, v in value.items() if device != "cpu"}
            if "cuda" in value:
                routed["cpu"] = value["cuda"]
        else:
            routed = {device for device in value if device != "cpu"}
            if "cuda" in value:
                routed.add("cpu")
        set_runtime(monkeypatch, name, routed, pe)


def runtime_value(name: str, pe: torch.nn.Module | None = None) -> Any:
    """The runtime global ``name`` as ``pe``'s runtime holds it (a setting's dict, ...)."""
    values = [vars(module)[name] for module in runtime_modules(pe) if name in vars(module)]
    assert values, f"no runtime module binds {name}"
    return values[0]


def spy_calls(
    monkeypatch: pytest.MonkeyPatch,
    modules: list[ModuleType],
    name: str,
    record: Callable[..., Any],
) -> list[Any]:
    """Wrap the function ``name`` wherever one of ``modules`` binds it (where it is
    defined and where it is imported) for the test: each call still runs, and
    ``record`` of its arguments is appended to the returned list."""
    calls: list[Any] = []
    bound = [module for module in modules if name in vars(module)]
    assert bound, f"no module binds {name}"
    original = getattr(bound[0], name)

    def spy(*args: Any, **keywords: Any) -> Any:
        calls.append(record(*args, **keywords))
        return original(*args, **keywords)

    for module in bound:
        assert getattr(module, name) is original, f"{module.__name__}.{name} differs"
        monkeypatch.setattr(module, name, spy)
    return calls


def spy_method(
    monkeypatch: pytest.MonkeyPatch, cls: type, name: str, record: Callable[..., Any]
) -> list[Any]:
    """Wrap the method ``name`` of ``cls`` for the test: each call still runs, and
    ``record`` of its arguments (without self) is appended to the returned list."""
    calls: list[Any] = []
    original = getattr(cls, name)

    def spy(self: Any, *args: Any, **keywords: Any) -> Any:
        calls.append(record(*args, **keywords))
        return original(self, *args, **keywords)

    monkeypatch.setattr(cls, name, spy)
    return calls


def spy_query_shapes(
    monkeypatch: pytest.MonkeyPatch, pe: torch.nn.Module, name: str
) -> list[tuple[int, ...]]:
    """The shapes of the queries that reach the runtime function ``name`` of ``pe``
    (its first argument), one per call (a ``spy_calls`` record)."""
    return spy_calls(monkeypatch, runtime_modules(pe), name, lambda q, *_, **__: tuple(q.shape))


def bias_kind(q: Any, k: Any, v: Any, scale: float, *args: Any, **keywords: Any) -> str:
    """The ``bias_kind`` of a ``fused_distance_attention`` call (a ``spy_calls`` record)."""
    return str(args[1] if len(args) > 1 else keywords.get("bias_kind", "none"))


#: skips a test (or, as ``pytestmark``, a module) where Triton is not installed
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (pip install -c constraints/cpu.txt -e '.[dev]')",
)


def interpret_distance_kernels(
    monkeypatch: pytest.MonkeyPatch, pe: torch.nn.Module | None = None
) -> None:
    """Serve CPU tensors in ``pe``'s runtime (default: generated/'s) with the fused
    attention kernels (``_distance_kernel``, launched by ``_fused_distance``) defined
    afresh under TRITON_INTERPRET=1 for the test, every route of the flex backend to
    them open to the CPU."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    open_distance_kernels_to_cpu(monkeypatch, pe)
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        # the interpreter holds a scalar as a 1-element array, and NumPy 2.4 refuses
        # int() of one (a loop bound read from program_id: triton-lang/triton#9171)
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)


def open_distance_kernels_to_cpu(
    monkeypatch: pytest.MonkeyPatch, pe: torch.nn.Module | None = None
) -> None:
    """``pe``'s runtime (default: generated/'s) with the fused attention kernels defined
    afresh on first use in the test (as TRITON_INTERPRET then says), and the kernels and
    every route of the flex backend to them serving CPU tensors."""
    set_runtime(monkeypatch, "TRITON_CACHE", {}, pe)
    helpers = ("tile_logits", "larger", "plus", "diagonal_sums_into", "relative_tile")
    helpers += ("relative_logits", "relative_grad_into", "tile_row")
    for helper in helpers:
        set_runtime(monkeypatch, f"_distance_{helper}", None, pe)
    set_runtime(monkeypatch, "tl", None, pe)  # bound again with the kernels
    set_runtime(monkeypatch, "FUSED_DISTANCE_DEVICES", {"cpu"}, pe)
    set_runtime(monkeypatch, "FUSED_DISTANCE_ROUTES", {"slope": {"cpu"}, "vector": {"cpu"}}, pe)
    set_runtime(monkeypatch, "FUSED_RELATIVE_DEVICES", {"cpu"}, pe)
    set_runtime(monkeypatch, "FUSED_RELATIVE_TRAINED_DEVICES", {"cpu"}, pe)


class HostReads(TorchDispatchMode):
    """Counts, while active, the reads of device data into Python: each a sync on a GPU.

    A read is ``_local_scalar_dense`` (behind ``int(t)``, ``bool(t)``, ``.item()`` and
    indexing by a 0-d tensor) or ``Tensor.tolist()`` of a tensor that holds device data;
    with ``comparisons``, also ``torch.equal`` of tensors one of which does (off by
    default: the kept values' comparisons with the parameters are counted apart).
    On the CPU every tensor is on one device, so the data's origin decides: tensors made
    from Python values (``torch.tensor([...])``, dispatched as ``lift_fresh``) and those
    computed from them alone are host data, as they would be on a GPU, where such
    tensors stay on the CPU; everything else (the inputs, the module's parameters and
    caches, tensors made by factories such as ``torch.arange(..., device=...)`` and
    computed from any of them) is device data.
    """

    HOST_SOURCES = frozenset({"lift_fresh", "lift_fresh_copy"})

    def __init__(self, comparisons: bool = False) -> None:
        super().__init__()
        self.count = 0
        self._comparisons = comparisons
        self._host: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._tolist: Any = None

    def _is_host(self, tensor: Any) -> bool:
        return isinstance(tensor, torch.Tensor) and tensor in self._host

    def __enter__(self) -> HostReads:
        original = torch.Tensor.tolist
        self._tolist = original

        def tolist(tensor: torch.Tensor) -> Any:
            self.count += not self._is_host(tensor)
            return original(tensor)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense" and not self._is_host(args[0]):
            self.count += 1
        if name == "equal" and self._comparisons:
            self.count += not (self._is_host(args[0]) and self._is_host(args[1]))
        out = func(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if name in self.HOST_SOURCES or (inputs and all(map(self._is_host, inputs))):
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    self._host[tensor] = True
        return out


def hf_decode_step_reads(
    net: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[Any, int]:
    """A Hugging Face causal LM's prompt ``ids`` [2, L] (``mask``: its attention mask)
    into a fresh DynamicCache, then decode steps of tokens 5 and 7 and of 3 and 2: the
    second step's logits and its ``HostReads`` count. The first step makes what a decode
    loop keeps across steps (on the CPU, for instance, the depth of each module's kept
    bias vector, read once per vector: ``kept_row_is_shallow``)."""
    import transformers

    cache = transformers.DynamicCache()
    with torch.no_grad():
        net(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        step_mask = torch.cat((mask, torch.ones(2, 1, dtype=mask.dtype)), 1)
        net(torch.tensor([[5], [7]]), attention_mask=step_mask, past_key_values=cache)
        step_mask = torch.cat((step_mask, torch.ones(2, 1, dtype=mask.dtype)), 1)
        with HostReads() as counted:
            out = net(torch.tensor([[3], [2]]), attention_mask=step_mask, past_key_values=cache)
    return out.logits, counted.count
