"""CUDA's routes on the CPU: with every device setting of the runtime set as CUDA has it
(``cuda_routes``), the branches a GPU takes (no bias floor or distance-vector views, the
fold of TUPE-A's untied term, the one-read parameter comparison, SDPA without the CPU's
query chunks, ...) run in the CPU suite, where a GPU session is rare. Each backend
against the eager oracle, outputs and gradients, and the masks test's oracle cases."""

from __future__ import annotations

import warnings

import pytest

from tests.conftest import (
    DEVICE_ROUTES,
    KERNEL_ROUTES,
    assert_backends_agree_on_a_grouped_call,
    cuda_routes,
    generated_class,
    head_dim_for,
    runtime_modules,
    runtime_value,
    spec_names,
)

warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")

DEVICE_TYPES = {"cpu", "cuda"}


def _names_devices(value: object) -> bool:
    """Whether a runtime global is a device setting: a set or list of device types, a
    dict keyed by them, or a dict of such sets (tuples led by a device type count)."""
    if isinstance(value, dict):
        values = list(value.values())
        return bool(set(value) & DEVICE_TYPES) or any(_names_devices(v) for v in values)
    if isinstance(value, (set, frozenset, list)):
        heads = {item[0] if isinstance(item, tuple) and item else item for item in value}
        return bool(heads & DEVICE_TYPES)
    return False


def test_every_device_setting_is_routed_or_left_to_its_kernel_tests() -> None:
    """A new device setting must join DEVICE_ROUTES or KERNEL_ROUTES (conftest), so that
    cuda_routes cannot silently leave the CPU on its own route for it. Empty settings
    are named by their suffix (_DEVICES)."""
    found = set()
    for module in runtime_modules():
        for name, value in vars(module).items():
            if not name.isupper():
                continue
            empty = isinstance(value, (set, list)) and not value and name.endswith("_DEVICES")
            if empty or _names_devices(value):
                found.add(name)
    assert found == set(DEVICE_ROUTES) | set(KERNEL_ROUTES)


def test_cuda_routes_give_the_cpu_what_cuda_has(monkeypatch) -> None:
    cuda_routes(monkeypatch)
    assert "cpu" not in runtime_value("BIAS_FLOOR_DEVICES")  # {"cpu"} -> set()
    assert "cpu" in runtime_value("FOLDED_BIAS_DEVICES")  # {"cuda"} -> {"cuda", "cpu"}
    assert "cpu" not in runtime_value("SDPA_QUERY_CHUNK")  # {"cpu": 256} -> {}
    assert "cpu" not in runtime_value("FUSED_DISTANCE_DEVICES")  # a Triton kernel: untouched


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("name", spec_names())
def test_every_backend_agrees_with_eager_on_cuda_routes(
    name: str, causal: bool, explicit: bool, monkeypatch
) -> None:
    """sdpa, flex (unfused on the CPU) and auto against eager, outputs and gradients into
    q, k, v and the parameters, grouped-query heads, causal or not, at default and
    explicit positions (evaluation mode: randomized positions draw anew in training)."""
    cuda_routes(monkeypatch)
    pe = generated_class(name)(heads=4, head_dim=head_dim_for(name, 8)).eval()
    assert_backends_agree_on_a_grouped_call(pe, causal, explicit)
