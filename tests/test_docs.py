"""The documents' code runs: README.md and every docs/*.md page, as a reader would run them.

[Note: runnable docs] Each page's fenced blocks run in order inside one temporary working
directory (with `examples/` and `benchmarks/` of the checkout linked into it), sharing one
namespace per page:

- a ```python block is executed; one preceded by `<!-- file: NAME -->` is written to NAME
  instead (a model file the next blocks compile), and one preceded by `<!-- skip-test -->`
  is left out (torchrun-only snippets);
- a block preceded by `<!-- output -->` holds what the python block before it prints, and
  must match it line by line (`...` stands for any text within a line);
- a ```sh / ```bash block preceded by `<!-- run -->` runs line by line as a command;
  in every other one, each `python -m partitioner ...` line must parse with the CLI's own
  argparse (`driver.cli`), so an option renamed or removed fails here.

Relative links between the pages must point at files that exist, and docs/architecture.md
must name every module of the four packages.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"(?:<!--\s*(?P<marker>[^>]*?)\s*-->\n)?^(?P<indent>[ ]*)```(?P<lang>\w*)\n(?P<body>.*?)\n[ ]*```", re.S | re.M)
_LINK = re.compile(r"\]\((?P<target>[^)#\s]+)(?:#[^)]*)?\)")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: its language, its marker comment (or ''), its text."""

    lang: str
    marker: str
    body: str
    line: int


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of `page`, in order, each with the marker comment just above it."""
    text = page.read_text()
    found = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start("lang")) + 1
        found.append(Block(m.group("lang"), (m.group("marker") or "").strip(), textwrap.dedent(m.group("body")), line))
    return found


def cli_lines(body: str) -> list[str]:
    """The `python -m partitioner ...` commands of a shell block, comments dropped."""
    joined = body.replace("\\\n", " ")
    return [line.split(" #")[0].strip() for line in joined.splitlines()
            if line.strip().startswith("python -m partitioner ")]


def parse_cli(command: str) -> None:
    """Parse one command line with the CLI's argparse (SystemExit on a bad option)."""
    from driver.cli import _parser

    _parser().parse_args(shlex.split(command)[3:])


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_shell(body: str, cwd: Path, where: str) -> None:
    """Each command of a `<!-- run -->` block, in `cwd`; a non-zero exit fails the test."""
    for command in body.replace("\\\n", " ").splitlines():
        command = command.split(" #")[0].strip()
        if not command or command.startswith("#"):
            continue
        done = subprocess.run(command, shell=True, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{where}: `{command}` exited {done.returncode}:\n{done.stdout}{done.stderr}"


def check_output(printed: str, shown: str, where: str) -> None:
    """What a python block printed against the `<!-- output -->` block after it: line by
    line, `...` any text within a line, trailing spaces ignored."""
    got = [line.rstrip() for line in printed.rstrip("\n").splitlines()]
    want = [line.rstrip() for line in shown.splitlines()]
    same = len(got) == len(want) and all(
        re.fullmatch("[^\n]*".join(map(re.escape, w.split("..."))), g) for g, w in zip(got, want))
    assert same, f"{where}: the block above printed\n{printed}\nnot what the page shows:\n{shown}"


def run_page(page: Path, work: Path) -> None:
    """Every block of `page`, in order, in `work`, one namespace for the page."""
    namespace: dict[str, Any] = {"__name__": f"docs_{page.stem}"}
    printed = ""
    for block in blocks(page):
        where = f"{page.name}, line {block.line}"
        if block.marker == "skip-test":
            continue
        if block.marker == "output":
            check_output(printed, block.body, where)
        elif block.lang == "python" and block.marker.startswith("file:"):
            (work / block.marker.split(":", 1)[1].strip()).write_text(block.body + "\n")
        elif block.lang == "python":
            with contextlib.redirect_stdout(io.StringIO()) as out:
                exec(compile(block.body, where, "exec"), namespace)
            printed = out.getvalue()
        elif block.lang in ("sh", "bash") and block.marker == "run":
            run_shell(block.body, work, where)
        elif block.lang in ("sh", "bash"):
            for command in cli_lines(block.body):
                parse_cli(command)


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh working directory with the checkout's examples/ and benchmarks/ linked in,
    importable (a page's model file is imported by name), torch on one thread."""
    for name in ("examples", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return tmp_path


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name if p.parent == ROOT else f"docs/{p.name}")
def test_page_code_runs(page: Path, workdir: Path) -> None:
    run_page(page, workdir)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name if p.parent == ROOT else f"docs/{p.name}")
def test_page_links_exist(page: Path) -> None:
    targets = [m.group("target") for m in _LINK.finditer(page.read_text())]
    missing = [t for t in targets if "://" not in t and not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_architecture_names_every_module() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    tree = text[text.index("## The tree"):text.index("Floors:")]
    named = _tree_paths(tree)
    modules = {str(p.relative_to(ROOT)) for pkg in ("partitioner", "codegen", "runtime", "driver")
               for p in (ROOT / pkg).rglob("*.py")}
    assert not modules - named, f"docs/architecture.md's tree misses {sorted(modules - named)}"
    assert not named - modules - {"benchmarks/", "tests/"}, f"it names modules that do not exist: {sorted(named - modules)}"


def _tree_paths(tree: str) -> set[str]:
    """The file paths an indented tree names (two spaces a level, folders ending in '/')."""
    paths, stack = set(), []
    for line in tree.split("```")[1].splitlines():
        if not line.strip():
            continue
        depth, name = (len(line) - len(line.lstrip())) // 2, line.split()[0]
        stack[depth:] = [name]
        if not name.endswith("/"):
            paths.add("".join(stack))
        elif depth == 0 and name in ("benchmarks/", "tests/"):
            paths.add(name)
    return paths


def test_a_drifting_snippet_fails(workdir: Path, tmp_path: Path) -> None:
    """The runner is not vacuous: a block that calls what does not exist, or a command line
    with an option the CLI lacks, fails."""
    page = tmp_path / "drift.md"
    page.write_text("```python\nimport runtime\nruntime.NoSuchPipeline('x')\n```\n")
    with pytest.raises(AttributeError):
        run_page(page, workdir)
    page.write_text("```sh\npython -m partitioner compile m.py --out d --no-such-option\n```\n")
    with pytest.raises(SystemExit):
        run_page(page, workdir)
    page.write_text("```python\nprint('offload', 'all', 1)\n```\n<!-- output -->\n```text\nmemory ... 1\n```\n")
    with pytest.raises(AssertionError, match="not what the page shows"):
        run_page(page, workdir)
    page.write_text("```python\nprint('offload', 'all', 1)\n```\n<!-- output -->\n```text\noffload ... 1\n```\n")
    run_page(page, workdir)
