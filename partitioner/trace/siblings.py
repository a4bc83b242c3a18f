"""The modules of a model file's own folder that it imports: what a package copies beside
its copy of the model file ([Note: the model file's copy] in runtime/manifest.py).

Found by reading the import statements (`import gpt`, `from gpt import GPT`) of the model
file and, in turn, of each module found, never by running anything: a name is the folder's
when `<folder>/<name>.py` exists.  A package (a folder with `__init__.py`) and a module
imported from elsewhere are not copied; they are found on `sys.path` when the package loads.
"""

from __future__ import annotations

import ast
from pathlib import Path

__all__ = ["sibling_modules"]


def sibling_modules(path: str | Path) -> dict[str, bytes]:
    """`<name>.py` -> its bytes, for every module of the folder of `path` that `path`
    imports, directly or through another such module, in name order."""
    model = Path(path).resolve()
    found: dict[str, bytes] = {}
    todo = [model]
    while todo:
        for name in sorted(_imported_names(todo.pop().read_bytes())):
            file = model.parent / f"{name}.py"
            if file.name not in found and file != model and file.is_file():
                found[file.name] = file.read_bytes()
                todo.append(file)
    return dict(sorted(found.items()))


def _imported_names(source: bytes) -> set[str]:
    """The top-level names of every absolute import in `source` (none if it does not parse)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names
