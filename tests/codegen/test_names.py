"""Names in the generated stages: values after their module, tied tensors after
their first reader, section lines where the module changes."""

from __future__ import annotations

import keyword
import operator

import torch
import torch.fx
import torch.utils._pytree as pytree

from codegen.layout import lay_out
from codegen.names import attr_names, module_roots, section, value_names


def _node(graph: torch.fx.Graph, module: str, *args: object) -> torch.fx.Node:
    node = graph.call_function(operator.add, args)  # type: ignore[arg-type]
    if module:
        node.meta["nn_module_stack"] = {module: (module, torch.nn.Module)}
    return node


def _chain(modules: list[str]) -> tuple[torch.fx.Graph, list[torch.fx.Node]]:
    """x -> one add per module -> output; every add read by the next."""
    graph = torch.fx.Graph()
    value = graph.placeholder("x")
    nodes = []
    for module in modules:
        value = _node(graph, module, value, 1)
        nodes.append(value)
    graph.output(value)
    return graph, nodes


def test_a_value_is_named_after_the_module_that_makes_it() -> None:
    graph, nodes = _chain(["h.0.attn", "h.0", "h.0", "", "h.1"])
    names = value_names(graph)
    # a module's output takes its name; a value inside a module adds its op; the model's own keeps the op
    assert [names[n] for n in nodes] == ["h_0_attn", "h_0_add", "h_0", "add", "h_1"]


def test_the_wrapper_module_is_left_out_of_the_names() -> None:
    graph, nodes = _chain(["transformer.wte", "transformer", "transformer.h.0.attn.c_attn", "transformer.h.0"])
    names = value_names(graph)
    assert [names[n] for n in nodes] == ["wte", "add", "h_0_attn_c_attn", "h_0"]


def test_value_names_are_unique_identifiers_whatever_the_modules_are_called() -> None:
    graph, nodes = _chain(["0", "0", "lambda", "add_1", "a-b", "a_b", "x"])
    names = value_names(graph)
    assert names == value_names(graph)  # deterministic
    assert len(set(names.values())) == len(names)
    assert all(n.isidentifier() and not keyword.iskeyword(n) for n in names.values())
    assert [names[n] for n in nodes] == ["m_0_add", "m_0", "lambda_", "add_1", "a_b", "a_b_1", "x_1"]


def test_the_items_of_a_tuple_are_named_after_it() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    split = graph.call_method("split", (x, 2))
    parts = [graph.call_function(operator.getitem, (split, i)) for i in range(2)]
    total = graph.call_function(operator.add, tuple(parts))
    for node in (split, *parts, total):
        node.meta["nn_module_stack"] = {"h.0.attn": ("h.0.attn", torch.nn.Module)}
    graph.output(total)
    names = value_names(graph)
    assert [names[n] for n in (split, *parts, total)] == ["h_0_attn_split", "h_0_attn_split_0", "h_0_attn_split_1",
                                                          "h_0_attn"]


def test_a_tied_tensor_is_named_after_its_first_reader_in_each_stage() -> None:
    graph = torch.fx.Graph()
    ids = graph.placeholder("ids")
    weight = graph.get_attr("lm_head.weight")
    embed = _node(graph, "transformer.wte", weight, ids)
    head = _node(graph, "lm_head", embed, weight)
    graph.output(head)
    aliases = {"transformer.wte.weight": "lm_head.weight"}
    first, second = lay_out(graph, {embed.name: 0, head.name: 1}, 2)
    assert attr_names(first, aliases) == {"lm_head.weight": "transformer_wte_weight"}
    assert attr_names(second, aliases) == {"lm_head.weight": "lm_head_weight"}
    assert attr_names(second, {}) == {"lm_head.weight": "lm_head_weight"}


def test_sections_stop_one_level_below_the_layer_index() -> None:
    graph, nodes = _chain(["transformer.h.0.attn.c_attn", "transformer.h.0", "transformer.wte", "enc.q", ""])
    assert [section(n) for n in nodes] == [
        "transformer.h.0.attn", "transformer.h.0", "transformer.wte", "enc.q", "(top level)"]


def test_a_value_is_not_named_after_a_package_the_stage_imports() -> None:
    graph, nodes = _chain(["transformers", "head"])
    assert value_names(graph)[nodes[0]] == "transformers"
    assert value_names(graph, {"transformers"})[nodes[0]] == "transformers_1"
    assert module_roots(pytree.tree_structure((1, {"a": 2}))) == {"builtins"}
