"""The names a person reads in the stage sources: every name is given here, once.

- A value is named after the module that makes it ([Note: value names]): `h_0_attn_c_attn`
  for that module's output, `h_0_attn_view` for a value inside it, `h_0_attn_split_1` for
  an item of a tuple; a value of the model's own forward keeps its op's name (`add`).
- A tensor attribute is named after its state_dict key; a tied tensor (several keys, one
  storage) after the key of the module that first reads it in the stage, so GPT-2's token
  embedding reads `self.transformer_wte_weight` and its LM head `self.lm_head_weight`.
- A section comment, `# -- transformer.h.0.attn --`, opens each run of statements from one
  module, cut one level below the layer index (`h.0.attn.c_attn` is part of `h.0.attn`).

[Note: value names]
The manifest matches a stage's inputs to an earlier stage's outputs by name, so a value has
one name in every stage and file: `value_names` gives it for the whole graph, and the source
and the manifest both read it from there.  A name is the module path of the value without
the model's wrapper (`transformer.` of `transformer.h.0`, `model.` of `model.layers.3`),
then the op unless the value is the module's output (the one value of it read outside it).
Names are unique among the graph's inputs and attributes and the generated code's own
(`self`, `torch`, `F`, `aten`, builtins), valid identifiers, and deterministic (graph order
decides who gets a suffix).
"""

from __future__ import annotations

import builtins
import keyword
import operator
import re
from typing import Iterable

import torch.fx
import torch.utils._pytree as pytree

from partitioner.trace.passes import node_module

from .layout import StageLayout

__all__ = ["attr_name", "attr_names", "group", "module_roots", "section", "spec_class", "value_names"]

#: names the generated stage files use themselves
_RESERVED = frozenset({"self", "torch", "F", "aten", "tp", "os", "Any", "annotations", "constants",
                        "model", "model_file_of"}) | frozenset(
    dir(builtins)
)


def attr_name(source_name: str) -> str:
    """`h.0.attn.c_attn.weight` -> `h_0_attn_c_attn_weight`."""
    name = source_name.replace(".", "_").lstrip("_") or "attr"
    return f"p_{name}" if name[0].isdigit() else name


def value_names(graph: torch.fx.Graph, reserved: Iterable[str] = ()) -> dict[torch.fx.Node, str]:
    """The name of every node in the stage sources and the manifest ([Note: value names]);
    `reserved`: more names the stages use (the packages they import, `module_roots`)."""
    names = {n: n.name for n in graph.nodes if n.op in ("placeholder", "get_attr", "output")}
    taken = set(names.values()) | _RESERVED | set(reserved)
    taken |= {str(getattr(n.target, "__module__", None) or "").split(".")[0] for n in graph.nodes if callable(n.target)}
    outputs = _outputs_of_modules(graph)
    prefixes = _prefixes({node_module(n) for n in graph.nodes})
    for node in graph.nodes:
        if node not in names:
            names[node] = _unique(_want(node, names, prefixes[node_module(node)], node in outputs), taken)
            taken.add(names[node])
    return names


def _want(node: torch.fx.Node, names: dict[torch.fx.Node, str], prefix: str, output: bool) -> str:
    """A node's name before it is made unique: its module's for the module's output, else
    `<module>_<op>`, or `<tuple>_<index>` for an item of a tuple (`split`'s parts)."""
    if output:
        return _identifier(prefix)
    if node.target is operator.getitem and isinstance(node.args[1], int) and node.args[0] in names:
        return f"{names[node.args[0]]}_{node.args[1]}"  # type: ignore[index]
    return _identifier("_".join(p for p in (prefix, _op(node)) if p))


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
    cls = spec_class(spec)
    roots = {cls.__module__.split(".")[0]} if cls is not None else set()
    return roots.union(*(module_roots(c) for c in spec.children()))


def spec_class(spec: pytree.TreeSpec) -> type | None:
    """The class a node of an output's structure is an instance of: a NamedTuple's or
    structseq's own (pytree's node type is then `namedtuple` or `structseq`, the class its
    context), else the node type; None for a leaf."""
    if spec.is_leaf():
        return None
    if spec.type in (pytree.namedtuple, pytree.structseq) and isinstance(spec.context, type):
        return spec.context
    return spec.type if isinstance(spec.type, type) else None


def section(node: torch.fx.Node) -> str:
    """The module a statement is listed under: `transformer.h.0.attn` for a node of
    `transformer.h.0.attn.c_attn`; `(top level)` for the model's own forward."""
    return _cut(node_module(node), below=2) or "(top level)"


def group(module: str) -> str:
    """The group a parameter of `module` is declared in: its layer (`transformer.h.0` for
    `transformer.h.0.attn.c_attn`), or the module itself outside the layers."""
    return _cut(module, below=1) or "(top level)"


def _cut(module: str, below: int) -> str:
    """`module`'s path kept to `below` parts from its first layer index (the index itself is 1)."""
    parts = module.split(".") if module else []
    layer = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return ".".join(parts if layer is None else parts[: layer + below])


def _outputs_of_modules(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes that are their module's output: for each module, the last of its values
    that something outside it reads, when it is the only such value."""
    read_outside: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        module = node_module(node) if node.op not in ("placeholder", "get_attr", "output") else ""
        if module and any(not _inside(node_module(u), module) or u.op == "output" for u in node.users):
            read_outside.setdefault(module, []).append(node)
    return {nodes[0] for nodes in read_outside.values() if len(nodes) == 1}


def _inside(module: str, outer: str) -> bool:
    return module == outer or module.startswith(outer + ".")


def _prefixes(modules: set[str]) -> dict[str, str]:
    """Each module path as the prefix of its values' names: its dotted path without the
    model's wrapper (`transformer.h.0.attn` -> `h.0.attn`, `transformer.wte` -> `wte`), and
    nothing for the wrapper itself or the top level ([Note: value names])."""
    wrappers = {m.split(".")[0] for m in modules if "." in m}
    prefixes = {}
    for module in modules:
        parts = module.split(".") if module else []
        if len(parts) > 1 and not parts[1].isdigit():
            parts = parts[1:]
        elif len(parts) == 1 and parts[0] in wrappers:
            parts = []
        prefixes[module] = ".".join(parts)
    return prefixes


def _identifier(module: str) -> str:
    """`h.0.attn` -> `h_0_attn`; `0` (a Sequential's child) -> `m_0`."""
    name = re.sub(r"\W", "_", module.replace(".", "_")).strip("_") or "value"
    return f"m_{name}" if name[0].isdigit() else name


#: shorter words for ops whose own names are long
_SHORT = {"scaled_dot_product_attention": "sdpa", "_scaled_dot_product_flash_attention_for_cpu": "sdpa",
          "_scaled_dot_product_efficient_attention": "sdpa", "_scaled_dot_product_flash_attention": "sdpa",
          "native_layer_norm": "layer_norm", "_native_batch_norm_legit_functional": "batch_norm",
          "_native_batch_norm_legit": "batch_norm", "_native_batch_norm_legit_no_training": "batch_norm"}


def _op(node: torch.fx.Node) -> str:
    """The word for what `node` computes: its op without fx's counters (`linear`, `view`),
    shortened where the op's own name is long (`sdpa`)."""
    word = re.sub(r"_\d+(?=_|$)", "", node.name) or node.name
    return _SHORT.get(word, word)


def _unique(want: str, taken: set[str]) -> str:
    name = f"{want}_" if keyword.iskeyword(want) else want
    k = 1
    while name in taken:
        name, k = f"{want}_{k}", k + 1
    return name
