"""What the cost passes share about a graph's nodes: which compute, which parameters they
read, which storage a tensor has, and how many bytes a value holds."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

__all__ = ["compute_nodes", "needs_grad", "nbytes", "param_names", "storage_key", "tensors", "total_bytes"]


def compute_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def param_names(node: torch.fx.Node, params: set[str]) -> tuple[str, ...]:
    """Original names of the parameters `node` reads directly."""
    return tuple(sorted({str(a.target) for a in node.all_input_nodes if a.op == "get_attr" and a.target in params}))


def storage_key(t: torch.Tensor) -> int:
    """Identifies a tensor's storage, shared by its views; meta tensors included."""
    return int(t.untyped_storage()._cdata)



# -- sizes -------------------------------------------------------------------------------


def tensors(value: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    torch.fx.node.map_aggregate(value, lambda v: out.append(v) if isinstance(v, torch.Tensor) else None)
    return out


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def total_bytes(value: Any) -> int:
    return sum(nbytes(t) for t in tensors(value))


def needs_grad(value: Any) -> bool:
    return any(t.requires_grad for t in tensors(value))
