"""Static checks that keep the packages honest: mypy (disallow_untyped_defs) and ruff."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from .conftest import ROOT


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_mypy_is_clean() -> None:
    pytest.importorskip("mypy")
    proc = _run("mypy", "partitioner", "codegen", "runtime", "driver")
    assert proc.returncode == 0, proc.stdout[-4000:]


def test_ruff_is_clean() -> None:
    if shutil.which("ruff") is None and _run("ruff", "--version").returncode != 0:
        pytest.skip("ruff is not installed")
    proc = _run("ruff", "check", ".")
    assert proc.returncode == 0, proc.stdout[-4000:]
