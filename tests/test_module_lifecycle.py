"""A generated module through the life a model gives it besides forward: built on the
meta device and initialised in place (``reset_parameters``), copied, shown."""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.conftest import generated_class, head_dim_for, spec_names


def _sizes(name: str) -> dict[str, int]:
    cls = generated_class(name)
    sizes = {"heads": 4, "head_dim": head_dim_for(name, 16)}
    if "model_dim" in inspect.signature(cls.__init__).parameters:
        sizes["model_dim"] = 32
    return sizes


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, persistent or not, by name."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


@pytest.mark.parametrize("name", spec_names())
def test_a_module_built_on_the_meta_device_initialises_as_a_new_one(name: str) -> None:
    """``to_empty`` then ``reset_parameters`` gives every parameter and buffer (the
    non-persistent ones too: FIRE's threshold, ALiBi's slopes) the values of a module
    built normally from the same seed, and the same outputs."""
    cls, sizes = generated_class(name), _sizes(name)
    torch.manual_seed(0)
    built = cls(**sizes).eval()
    with torch.device("meta"):
        deferred = cls(**sizes)
    assert all(t.is_meta for t in _tensors(deferred).values())
    deferred.to_empty(device="cpu")
    torch.manual_seed(0)
    deferred.reset_parameters()
    deferred.eval()
    want = _tensors(built)
    got = _tensors(deferred)
    assert got.keys() == want.keys()
    for key, tensor in got.items():
        assert torch.equal(tensor, want[key]), key
    q, k, v = (torch.randn(2, 4, 6, sizes["head_dim"]) for _ in range(3))
    assert torch.equal(deferred(q, k, v, causal=True), built(q, k, v, causal=True))


@pytest.mark.parametrize("name", ["t5", "deberta", "alibi_learned", "floater"])
def test_reset_parameters_undoes_training_in_the_modules_dtype(name: str) -> None:
    """After an optimiser step, in float64: the initial values again, in float64, and
    no value kept from the trained parameters is served."""
    cls, sizes = generated_class(name), _sizes(name)
    torch.manual_seed(3)
    initial = cls(**sizes).double().eval()
    torch.manual_seed(3)
    trained = cls(**sizes).double().eval()
    q, k, v = (torch.randn(1, 4, 6, sizes["head_dim"], dtype=torch.float64) for _ in range(3))
    x = torch.randn(1, 6, sizes.get("model_dim", 8), dtype=torch.float64)
    use = (lambda pe: pe.embed(x)) if name == "floater" else (lambda pe: pe(q, k, v))
    with torch.no_grad():
        use(trained)  # keeps values of the parameters (CPU, no autograd)
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.5)
    use(trained).square().sum().backward()
    optimizer.step()
    with torch.no_grad():
        assert not torch.allclose(use(trained), use(initial))
        torch.manual_seed(3)
        trained.reset_parameters()
        for key, tensor in _tensors(trained).items():
            assert tensor.dtype == _tensors(initial)[key].dtype, key
            assert torch.equal(tensor, _tensors(initial)[key]), key
        assert torch.equal(use(trained), use(initial))


def test_model_apply_leaves_the_specs_initialisation_last() -> None:
    """``model.apply`` calls the submodules' ``reset_parameters`` first (an nn.Embedding's:
    N(0, 1)) and the encoding's after them: BERT's table is N(0, 0.02) again."""
    pe = generated_class("bert_relative_key")(heads=4, head_dim=16)
    model = torch.nn.Sequential(pe)
    model.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    std = float(pe.distance_embedding.weight.detach().std())
    assert 0.018 < std < 0.022, std  # 1023 x 16 draws: the estimate is within 2%


def test_the_repr_names_every_size_given() -> None:
    pe = generated_class("sinusoidal")(heads=4, head_dim=16, model_dim=32)
    assert "heads=4, head_dim=16, model_dim=32, scale=0.25" in repr(pe)
    assert "value_dim" not in repr(generated_class("shaw")(heads=4, head_dim=16))


def test_a_module_built_in_float64_holds_its_init_exactly(tmp_path) -> None:
    """An expression parameter's init (the value after softplus) is exact in a module
    built under a float64 default dtype, as the docs say, for references written from the
    spec; ``.double()`` of a float32 module widens the float32 value."""
    from posgen.codegen.inmemory import encoding_class, module_from_spec
    from tests.conftest import expr_bias_spec

    params = "{a: {shape: [], init: 1.5, positive: true}, b: {shape: [heads], init: 0.1}}"
    path = expr_bias_spec(tmp_path, "penalty", "-a * log(1 + abs(i - j)) + b[h]", params=params)
    cls = encoding_class(module_from_spec(path))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        pe = cls()
    finally:
        torch.set_default_dtype(default)
    assert torch.nn.functional.softplus(pe.expr_a).item() == 1.5
    assert pe.expr_b.tolist() == [0.1, 0.1]
    widened = cls().double()
    assert torch.nn.functional.softplus(widened.expr_a).item() != 1.5  # float32's value
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(3))
    assert pe(q, k, v, causal=True).dtype == torch.float64


@pytest.mark.parametrize("name", spec_names())
def test_a_module_built_in_float64_holds_every_tensor_in_float64(name: str) -> None:
    """Parameters and buffers take torch's default dtype, so that a float64 reference
    built from the spec computes in float64 throughout (complex_order's frequencies and
    ALiBi's slopes were float32 whatever the default)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        pe = generated_class(name)()
    finally:
        torch.set_default_dtype(default)
    tensors = [*pe.named_parameters(), *pe.named_buffers()]
    narrow = [
        (key, t.dtype) for key, t in tensors if t.is_floating_point() and t.dtype != torch.float64
    ]
    assert not narrow, narrow
