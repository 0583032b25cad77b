"""Build a spec's module in memory, without writing into generated/.

Used by ``posgen check`` and by tests: a new idea needs nothing but a YAML file. The
module is the standalone rendering (the runtime inlined), so what is checked is one
self-contained source text.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

from torch import nn

from posgen.codegen.render import render_standalone
from posgen.codegen.writing import plan_for
from posgen.spec.loader import LoadedSpec, load_spec


def module_from_loaded(loaded: LoadedSpec) -> types.ModuleType:
    """Render, compile and execute the module of an already loaded spec."""
    plan = plan_for(loaded)
    source = render_standalone(plan)
    name = f"posgen_inmemory.{plan.module_name}"
    module = types.ModuleType(name)
    module.__file__ = f"<posgen:{loaded.display_path}>"
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def module_from_spec(path: Path) -> types.ModuleType:
    """Load, validate, render and execute one spec file (raises SpecError if invalid)."""
    return module_from_loaded(load_spec(path))


def encoding_class(module: types.ModuleType) -> type[nn.Module]:
    """The encoding class a generated module exports."""
    (class_name,) = module.__all__
    cls: type[nn.Module] = getattr(module, class_name)
    return cls
