"""Every Python snippet in README.md and docs/*.md runs as written.

Blocks fenced as ```python are executed in order, one namespace per file (a later block
may use what an earlier one defined), from a temporary working directory with the
repository importable. Blocks meant as fragments or output use another fence (```text,
```yaml, ```bash) and are not run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT

FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
DOCUMENTS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


def snippets(path: Path) -> list[tuple[int, str]]:
    """(line, code) of each ```python block of a Markdown file."""
    text = path.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in FENCE.finditer(text)]


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_python_snippets_run_as_written(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    torch.manual_seed(0)
    namespace: dict[str, object] = {"__name__": f"snippets_of_{path.stem}"}
    for line, code in snippets(path):
        try:
            exec(compile(code, f"{path.name}:{line}", "exec"), namespace)
        except Exception as error:
            pytest.fail(f"{path.name}, snippet at line {line}: {type(error).__name__}: {error}")


def test_the_documents_have_snippets() -> None:
    assert snippets(ROOT / "README.md"), "README.md shows no runnable Python"
