"""The runtime's Triton kernels compile for a Hopper GPU (sm_90), here, without one.

The rest of the CPU suite runs the kernels under TRITON_INTERPRET=1, which neither types
them nor resolves their parameters' annotations: kernels that ran there failed to
compile on an H200 (``NameError: tl`` in the relative terms' helper, whose body never
named ``tl``). Here each launch the runtime makes is recorded instead of run, with the
arguments it passes, and compiled ahead of time for sm_90 by Triton's own compiler
(through ptxas), once per autotuning candidate where the kernel is autotuned on CUDA;
at least one candidate of each kernel must fit the shared memory of a Hopper block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.conftest import (
    generated_class,
    needs_triton,
    open_distance_kernels_to_cpu,
    runtime_value,
    set_runtime,
)

pytestmark = needs_triton

#: the shared memory one block may opt into on an H100 or H200 (227 KiB)
HOPPER_SHARED_BYTES = 232448
POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.int32: "*i32",
    torch.int64: "*i64",
}


#: recorded launches: (kernel name, positional arguments, keyword arguments)
Launches = list[tuple[str, tuple[Any, ...], dict[str, Any]]]


class Launch:
    """A kernel's launches, recorded (``kernel[grid](*args, **meta)``) instead of run."""

    def __init__(self, name: str, record: Launches):
        self.name, self.record = name, record

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **meta: Any) -> None:
            self.record.append((self.name, args, meta))

        return launch


def compiled_for_hopper(kernel: Any, args: tuple[Any, ...], meta: dict[str, Any]) -> Any:
    """``kernel`` (a triton.JITFunction) compiled for sm_90 with the argument types and
    constexpr values of one recorded launch; ``num_warps`` and ``num_stages`` in ``meta``
    are compiler options."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = {key: meta[key] for key in ("num_warps", "num_stages") if key in meta}
    values = list(args)
    signature: dict[str, str] = {}
    constants: dict[tuple[int, ...], Any] = {}
    for param in kernel.params:
        if param.name in meta:
            value = meta[param.name]
        elif values:
            value = values.pop(0)
        else:  # a default
            continue
        if param.is_constexpr or value is None:
            signature[param.name] = "constexpr"
            constants[(param.num,)] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = POINTER_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"argument {param.name} of {kernel.__name__}: {value!r}")
    assert not values, f"{len(values)} arguments left over for {kernel.__name__}"
    source = ASTSource(kernel, signature, constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


@pytest.fixture(autouse=True)
def compiled_afresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Kernels defined as compiled (not interpreted) Triton functions and compiled into
    an empty cache: Triton's on-disk cache keys a kernel by its source, so a change
    outside it (such as a global it resolves) would otherwise find the old binary."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))


@pytest.fixture
def compiling(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The fused attention kernels defined afresh, their CPU launches recorded in
    ``"launches"``."""
    open_distance_kernels_to_cpu(monkeypatch)
    set_runtime(monkeypatch, "FUSED_DISTANCE_TRAINED_DEVICES", {"cpu"})
    kernels = runtime_value("distance_attention_kernels")()
    launches: Launches = []
    runtime_value("TRITON_CACHE")["attention"] = {name: Launch(name, launches) for name in kernels}
    return {"kernels": kernels, "launches": launches}


@pytest.mark.parametrize(
    ("name", "dtype", "causal", "window"),
    [
        ("alibi", torch.bfloat16, True, None),  # the slope, per score
        ("alibi_learned", torch.float16, False, 64),  # a slope that trains
        ("kerple_log", torch.bfloat16, False, None),  # a full vector that trains
        ("t5", torch.float32, True, 96),  # a clipped vector that trains (IEEE products)
        ("deberta", torch.bfloat16, False, None),  # both sides through diagonals, trained
        ("transformer_xl", torch.float16, True, None),  # a key-side term per key
    ],
)
def test_fused_attention_kernels_compile_for_hopper(
    compiling: dict[str, Any], name: str, dtype: torch.dtype, causal: bool, window: int | None
) -> None:
    """A training step's launches of flex's fused route for each bias form and relative
    term layout (forward, δ = dO · O, dK and dV, dQ with the bias's or terms' gradient),
    each compiled for sm_90 with every autotuning candidate."""
    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=64).to(dtype)
    q = torch.randn(1, 4, 192, 64, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, 2, 192, 64, dtype=dtype, requires_grad=True) for _ in range(2))
    out = pe(q, k, v, backend="flex", causal=causal, window=window)
    out.float().sum().backward()  # the outputs are never written: only launches count
    launches = compiling["launches"]
    assert sorted(launch[0] for launch in launches) == [
        "forward",
        "key_grad",
        "query_grad",
        "row_dots",
    ]
    configs = runtime_value("_distance_attention_configs")
    for kernel_name, args, meta in launches:
        kernel = compiling["kernels"][kernel_name]
        if kernel_name == "row_dots":  # not autotuned
            tiles = [{}]
        else:
            tiles = [
                {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}
                for config in configs(kernel_name)
            ]
        shared = [
            compiled_for_hopper(kernel, args, {**meta, **tile}).metadata.shared for tile in tiles
        ]
        assert min(shared) <= HOPPER_SHARED_BYTES, (kernel_name, shared)


@pytest.mark.parametrize("half_pairing", [True, False])
def test_rotation_kernel_compiles_for_hopper(
    monkeypatch: pytest.MonkeyPatch, half_pairing: bool
) -> None:
    """The fused rotation's launches (bf16, the rotation of rotate_keys and the inverse
    rotation of its backward), compiled for sm_90 with their launch options."""
    set_runtime(monkeypatch, "TRITON_CACHE", {})
    set_runtime(monkeypatch, "FUSED_ROTATION_DEVICES", ["cuda", "cpu"])
    kernel = runtime_value("_rotation_kernel")()
    launches: Launches = []
    runtime_value("TRITON_CACHE")["kernel"] = Launch("rotate", launches)
    name = "rope" if half_pairing else "rope_gptj"
    pe = generated_class(name)(heads=4, head_dim=64)
    k = torch.randn(2, 4, 40, 64, dtype=torch.bfloat16, requires_grad=True)
    rotated = pe.rotate_keys(k)
    rotated.float().sum().backward()
    assert [meta["INVERSE"] for _, _, meta in launches] == [False, True]
    for _, args, meta in launches:
        assert meta["HALF_PAIRING"] == half_pairing
        compiled = compiled_for_hopper(kernel, args, meta)
        assert compiled.metadata.shared <= HOPPER_SHARED_BYTES
