"""Golden outputs of every generated module, recorded before the runtime redesign.

``collect(cls)`` runs one module class on fixed seeded inputs and returns everything
observable: forward on the auto, eager and sdpa backends in float64 (causal and not,
default and explicit positions) and on auto in float32 (causal and not, default
positions), ``score_terms``, ``rotate``, ``embed``, ``score_bias`` and the
state_dict's keys and shapes. Errors are recorded by type name, so a call that used to
raise must still raise.

Record (only when behaviour is meant to change, and say so in the commit)::

    python -m tests.golden

Add the entries of new specs, leaving every recorded one as it is::

    python -m tests.golden --add-new

Record again only the named specs (a deliberate change to their behaviour)::

    python -m tests.golden --rerecord NAME [NAME ...]
"""

from __future__ import annotations

import gzip
import inspect
import io
from pathlib import Path
from typing import Any

import torch

GOLDEN_FILE = Path(__file__).resolve().parent / "golden" / "outputs.pt.gz"

HEADS, HEAD_DIM, MODEL_DIM = 2, 8, 16
N, M, BATCH = 5, 7, 2
Q_POSITIONS = torch.tensor([4, 5, 8, 9, 10])
K_POSITIONS = torch.tensor([0, 1, 2, 4, 5, 8, 9])


def _build(cls: type[torch.nn.Module]) -> torch.nn.Module:
    params = inspect.signature(cls.__init__).parameters
    kwargs: dict[str, int] = {"heads": HEADS, "head_dim": HEAD_DIM}
    if "model_dim" in params:
        kwargs["model_dim"] = MODEL_DIM
    torch.manual_seed(0)
    try:
        module = cls(**kwargs)
    except ValueError:  # a rotation sized for its own head_dim (M-RoPE sections, LongRoPE)
        del kwargs["head_dim"]
        torch.manual_seed(0)
        module = cls(**kwargs)
    return module.eval()  # evaluation: positions are never randomized


def _record(out: dict[str, Any], key: str, call: Any, *args: Any, **kwargs: Any) -> None:
    try:
        value = call(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the error type is the recorded behaviour
        out[key] = f"raises {type(error).__name__}"
        return
    if isinstance(value, dict):
        for name, tensor in value.items():
            out[f"{key}.{name}"] = tensor.detach().clone()
    elif isinstance(value, tuple):
        for index, tensor in enumerate(value):
            out[f"{key}.{index}"] = tensor.detach().clone()
    elif value is None:
        out[key] = "None"
    else:
        out[key] = value.detach().clone()


def collect(cls: type[torch.nn.Module]) -> dict[str, Any]:
    """Everything observable of one module class on fixed inputs."""
    out: dict[str, Any] = {}
    module = _build(cls)
    out["state_dict"] = sorted((k, tuple(v.shape)) for k, v in module.state_dict().items())
    module = module.double()
    generator = torch.Generator().manual_seed(1)
    head_dim = module.head_dim
    value_dim = getattr(module, "value_dim", head_dim)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q, k = randn(BATCH, HEADS, N, head_dim), randn(BATCH, HEADS, M, head_dim)
    v = randn(BATCH, HEADS, M, value_dim)
    width = MODEL_DIM if hasattr(module, "model_dim") else HEADS * head_dim
    x = randn(BATCH, N, width)
    explicit = {"q_positions": Q_POSITIONS, "k_positions": K_POSITIONS}
    for positions_name, positions in (("default", {}), ("explicit", explicit)):
        for backend in ("auto", "eager", "sdpa"):
            for causal in (False, True):
                key = f"forward.{backend}.{positions_name}.causal={causal}"
                _record(out, key, module, q, k, v, causal=causal, backend=backend, **positions)
        _record(out, f"score_terms.{positions_name}", module.score_terms, q, k, **positions)
        _record(out, f"rotate.{positions_name}", module.rotate, q, k, **positions)
    _record(out, "score_bias", module.score_bias, Q_POSITIONS, K_POSITIONS)
    _record(out, "embed.default", module.embed, x)
    _record(out, "embed.explicit", module.embed, x, Q_POSITIONS)
    module32 = module.float()
    q32, k32, v32 = q.float(), k.float(), v.float()
    for causal in (False, True):
        _record(out, f"float32.causal={causal}", module32, q32, k32, v32, causal=causal)
    return out


def load_golden() -> dict[str, dict[str, Any]]:
    """The recorded outputs (a gzip-compressed torch.save of ``collect_all()``)."""
    with gzip.open(GOLDEN_FILE, "rb") as stream:
        return torch.load(io.BytesIO(stream.read()), weights_only=True)


def collect_all() -> dict[str, dict[str, Any]]:
    from tests.conftest import generated_class, spec_names

    return {name: collect(generated_class(name)) for name in spec_names()}


def write_golden(outputs: dict[str, dict[str, Any]]) -> None:
    """Save the outputs, sorted by name, as a byte-stable gzip file."""
    GOLDEN_FILE.parent.mkdir(exist_ok=True)
    buffer = io.BytesIO()
    torch.save({name: outputs[name] for name in sorted(outputs)}, buffer)
    with gzip.GzipFile(GOLDEN_FILE, "wb", mtime=0) as stream:
        stream.write(buffer.getvalue())


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--add-new"]:
        from tests.conftest import generated_class, spec_names

        recorded = load_golden()
        added = [name for name in spec_names() if name not in recorded]
        recorded.update({name: collect(generated_class(name)) for name in added})
        write_golden(recorded)
        print(f"added {', '.join(added) or 'nothing'} to {GOLDEN_FILE}")
    elif sys.argv[1:2] == ["--rerecord"] and sys.argv[2:]:
        from tests.conftest import generated_class, spec_names

        recorded = load_golden()
        unknown = sorted(set(sys.argv[2:]) - set(recorded) - set(spec_names()))
        if unknown:
            sys.exit(f"no spec named {', '.join(unknown)}")
        recorded.update({name: collect(generated_class(name)) for name in sys.argv[2:]})
        write_golden(recorded)
        print(f"recorded {', '.join(sys.argv[2:])} again in {GOLDEN_FILE}")
    elif not sys.argv[1:]:
        write_golden(collect_all())
        print(f"wrote {GOLDEN_FILE} ({GOLDEN_FILE.stat().st_size} bytes)")
    else:  # anything else (--help, a typo) records nothing
        sys.exit(
            f"usage: python -m tests.golden [--add-new | --rerecord NAME [NAME ...]]\n{__doc__}"
        )
