"""``flush_denormals``: float denormals flushed to zero on every CPU thread torch uses,
when it is called before torch's first parallel operation, and a False return with a
warning when it is called too late (the worker threads keep their own mode).

Each case runs in a fresh interpreter with two intra-op threads: the flush mode is
process state, and this test process has long since started its thread pool.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys
import warnings

import torch

import generated._numerics as numerics

if sys.argv[1] == "late":
    (torch.ones(2**22) * 2).sum()  # a parallel operation: the worker threads start
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    flushed = numerics.flush_denormals()
# denormals from their bits: converting 1e-39 on a flushing thread would give 0
denormals = torch.full((2**22,), 0x00400000, dtype=torch.int32).view(torch.float32)
survivors = int(((denormals * 1.5) != 0).sum())
print(flushed, survivors, len(caught))
"""


def _run(when: str) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, when],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=True,
    )
    return done.stdout.split()


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"), reason="DAZ/FTZ are x86 modes"
)
def test_flush_denormals_before_the_first_operation_reaches_every_thread() -> None:
    flushed, survivors, warned = _run("early")
    assert (flushed, survivors, warned) == ("True", "0", "0")


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"), reason="DAZ/FTZ are x86 modes"
)
def test_flush_denormals_after_the_threads_started_says_it_did_not_reach_them() -> None:
    flushed, survivors, warned = _run("late")
    assert flushed == "False"
    assert int(survivors) > 0  # the worker thread still multiplies denormals
    assert warned == "1"
