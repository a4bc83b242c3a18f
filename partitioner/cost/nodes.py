"""What the cost passes share about a graph's nodes: which compute, which parameters they
read, which storage a tensor has, and how many bytes a value holds."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

from runtime.recompute import saves

__all__ = ["compute_dtype", "compute_nodes", "is_shape_only", "needs_grad", "nbytes", "param_names", "selective_keeps", "storage_key", "tensors",
           "total_bytes", "working_nodes"]


def compute_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def selective_keeps(node: torch.fx.Node) -> bool:
    """Whether selective recomputation keeps the node's output rather than run it again
    ([Note: recomputation policies] in runtime/recompute.py): a module kept whole counts
    as kept, whatever runs inside it."""
    return node.op == "call_module" or saves(node.target)


def working_nodes(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The compute nodes that work on the data ([Note: every stage computes] in
    solve/solve.py): those that read, through other nodes, a graph input or a parameter,
    but for views of their input (`node.meta["aliases"]` with no `writes`: a reshape, a
    transpose, split's pieces).  Not a buffer's own update (`num_batches_tracked += 1`),
    nor a mask built from constants."""
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    data: set[torch.fx.Node] = set()
    working: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" or (node.op == "get_attr" and node.target in params):
            data.add(node)
        elif node.op in ("call_function", "call_method", "call_module") and data.intersection(node.all_input_nodes):
            data.add(node)
            if "aliases" not in node.meta or "writes" in node.meta:
                working.add(node)
    return working


def param_names(node: torch.fx.Node, params: set[str]) -> tuple[str, ...]:
    """Original names of the parameters `node` reads directly."""
    return tuple(sorted({str(a.target) for a in node.all_input_nodes if a.op == "get_attr" and a.target in params}))


def storage_key(t: torch.Tensor) -> int:
    """Identifies a tensor's storage, shared by its views; meta tensors included."""
    return int(t.untyped_storage()._cdata)



def is_shape_only(t: torch.Tensor) -> bool:
    """Whether `t` holds a shape and a dtype but no data: a meta tensor, or a FakeTensor
    ([Note: mixed precision on the meta device] in partitioner/trace/fake.py)."""
    return t.is_meta or isinstance(t, FakeTensor)


# -- sizes -------------------------------------------------------------------------------


def tensors(value: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    torch.fx.node.map_aggregate(value, lambda v: out.append(v) if isinstance(v, torch.Tensor) else None)
    return out


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def total_bytes(value: Any) -> int:
    return sum(nbytes(t) for t in tensors(value))


def compute_dtype(out: Any, inputs: Any) -> torch.dtype | None:
    """The dtype a call computes in ([Note: a peak per dtype] in hardware.py): its first
    floating output's (autocast's matmul reads float32 and computes in bfloat16), else its
    first floating input's (a comparison), else None."""
    for value in (out, inputs):
        floats = [t.dtype for t in tensors(value) if t.is_floating_point()]
        if floats:
            return floats[0]
    return None


def needs_grad(value: Any) -> bool:
    return any(t.requires_grad for t in tensors(value))
