"""The names a person reads in the stage sources: every name is given here, once.

- A value that crosses a stage boundary is named after the module that makes it: `layers_4`
  when it is that module's last value (its output), `transformer_h_3_add` when the cut falls
  inside the module; a value a top-level op makes keeps its fx name.  Every other value
  keeps its fx name.  See [Note: boundary names].
- A tensor attribute is named after its state_dict key; a tied tensor (several keys, one
  storage) after the key of the module that first reads it in the stage, so GPT-2's token
  embedding reads `self.transformer_wte_weight` and its LM head `self.lm_head_weight`.
- A section comment, `# -- transformer.h.0.attn --`, opens each run of statements from one
  module, cut one level below the layer index (`h.0.attn.c_attn` is part of `h.0.attn`).

[Note: boundary names]
The manifest matches a stage's inputs to an earlier stage's outputs by name, so a boundary
value has one name in every stage and file: `value_names` gives it for the whole graph, and
the source and the manifest both read it from there.  Names are unique among every node
name of the graph and the generated code's own (`self`, `torch`, `F`, `aten`, builtins),
valid identifiers, and deterministic (graph order decides who gets a suffix).
"""

from __future__ import annotations

import builtins
import keyword
import re
from typing import Iterable

import torch.fx
import torch.utils._pytree as pytree

from partitioner.trace.passes import node_module

from .layout import StageLayout

__all__ = ["attr_name", "attr_names", "module_roots", "section", "value_names"]

#: names the generated stage files use themselves
_RESERVED = frozenset({"self", "torch", "F", "aten", "tp", "os", "Any", "annotations", "constants",
                        "model", "model_file_of"}) | frozenset(
    dir(builtins)
)


def attr_name(source_name: str) -> str:
    """`h.0.attn.c_attn.weight` -> `h_0_attn_c_attn_weight`."""
    name = source_name.replace(".", "_").lstrip("_") or "attr"
    return f"p_{name}" if name[0].isdigit() else name


def value_names(graph: torch.fx.Graph, layouts: list[StageLayout], reserved: Iterable[str] = ()) -> dict[torch.fx.Node, str]:
    """The name of every node in the stage sources and the manifest ([Note: boundary names]);
    `reserved`: more names the stages use (the packages they import, `module_roots`)."""
    names = {n: n.name for n in graph.nodes}
    taken = set(names.values()) | _RESERVED | set(reserved)
    taken |= {str(getattr(n.target, "__module__", None) or "").split(".")[0] for n in graph.nodes if callable(n.target)}
    last = _last_value_of_module(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    crossing = sorted({n for layout in layouts for n in layout.outputs}, key=order.__getitem__)
    for node in crossing:
        module = node_module(node)
        if not module:
            continue  # a top-level op: its fx name (`gelu_4`) is the model's own word for it
        base = _identifier(module)
        names[node] = _unique(base if last.get(module) is node else f"{base}_{_op(node.name)}", taken)
        taken.add(names[node])
    return names


def attr_names(layout: StageLayout, aliases: dict[str, str]) -> dict[str, str]:
    """The attribute name of each tensor the stage reads, by its canonical name (the graph's
    get_attr target); `aliases` maps the other state_dict keys of a tied tensor to it."""
    keys: dict[str, list[str]] = {}
    for key, canonical in sorted(aliases.items()):
        keys.setdefault(canonical, [canonical]).append(key)
    position = {n: i for i, n in enumerate(layout.nodes)}
    chosen: dict[str, str] = {}
    for attr in layout.attrs:
        target = str(attr.target)
        readers = sorted((u for u in attr.users if u in position), key=position.__getitem__)
        owner = node_module(readers[0]) if readers else None  # None: only the output reads it
        chosen[target] = attr_name(next((k for k in keys.get(target, []) if k.rpartition(".")[0] == owner), target))
    if len(set(chosen.values())) < len(chosen):  # two keys that differ only in "." and "_": keep the targets
        return {target: attr_name(target) for target in chosen}
    return chosen


def module_roots(spec: pytree.TreeSpec) -> set[str]:
    """The packages the last stage imports to rebuild the output (`transformers` for a
    ModelOutput): a value must not be named so."""
    roots = {spec.type.__module__.split(".")[0]} if isinstance(spec.type, type) else set()
    return roots.union(*(module_roots(c) for c in spec.children()))


def section(node: torch.fx.Node) -> str:
    """The module a statement is listed under: `transformer.h.0.attn` for a node of
    `transformer.h.0.attn.c_attn`; `(top level)` for the model's own forward."""
    parts = node_module(node).split(".")
    layer = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    kept = parts if layer is None else parts[: layer + 2]
    return ".".join(kept) or "(top level)"


def _last_value_of_module(graph: torch.fx.Graph) -> dict[str, torch.fx.Node]:
    """For each module path (and each path above it), the last node made inside it."""
    last: dict[str, torch.fx.Node] = {}
    for node in graph.nodes:
        module = node_module(node) if node.op not in ("placeholder", "get_attr", "output") else ""
        parts = module.split(".") if module else []
        for depth in range(1, len(parts) + 1):
            last[".".join(parts[:depth])] = node
    return last


def _identifier(module: str) -> str:
    """`transformer.h.3` -> `transformer_h_3`; `0` (a Sequential's child) -> `m_0`."""
    name = re.sub(r"\W", "_", module.replace(".", "_")).strip("_") or "value"
    return f"m_{name}" if name[0].isdigit() else name


def _op(name: str) -> str:
    """`add_16` -> `add`: the fx name without its counter."""
    return re.sub(r"_\d+$", "", name) or name


def _unique(want: str, taken: set[str]) -> str:
    name = f"{want}_" if keyword.iskeyword(want) else want
    k = 1
    while name in taken:
        name, k = f"{want}_{k}", k + 1
    return name
