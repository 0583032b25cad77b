"""Every generated module reproduces the outputs recorded before the runtime redesign."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import generated_class, spec_names
from tests.golden import collect, load_golden

GOLDEN = load_golden()


def test_golden_covers_the_catalogue() -> None:
    assert sorted(GOLDEN) == spec_names()


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_module_reproduces_its_golden_outputs(name: str) -> None:
    expected = GOLDEN[name]
    actual = collect(generated_class(name))
    assert sorted(actual) == sorted(expected)
    for key, want in expected.items():
        got = actual[key]
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor), key
            assert got.dtype == want.dtype and got.shape == want.shape, key
            if want.dtype == torch.float64:
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=key)
            else:
                torch.testing.assert_close(got, want, msg=key)
        else:
            assert got == want, key
