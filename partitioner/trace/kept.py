"""Submodules kept whole: what neither tracer can trace inside a larger model.

When fx and export both fail, the failure's deepest submodule (a data-dependent `if` in
its forward, say) is made an fx leaf and fx tries again, until the trace succeeds or the
failure is in the top-level module itself (then the compile is refused as before).

Each leaf call becomes one `call_function` node whose target is a `KeptModule` and whose
first argument is the module's state, `{name: get_attr(...)}` over every parameter and
buffer of it: the parameters stay ordinary get_attr reads of their original names (loaded,
saved, counted and placed like any other), and the node is costed as one node and placed
whole.  The generated stage holds the user's own module (`runtime.package.kept_module`)
and calls it on the stage's tensors: `torch.func.functional_call(self.block_module,
{"fc.weight": self.block_fc_weight, ...}, (x,))`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

__all__ = ["KeptModule", "failing_submodule", "rewrite_kept"]


@dataclass(frozen=True, eq=False)
class KeptModule:
    """A call of the user's module `path`, kept whole (`reason`: the line that broke tracing)."""

    module: torch.nn.Module
    path: str
    reason: str

    @property
    def __name__(self) -> str:  # fx and the cost passes name call targets
        return f"kept_{self.path.replace('.', '_')}"

    def __call__(self, state: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        return torch.func.functional_call(self.module, dict(state), args, kwargs)


def failing_submodule(exc: BaseException, model: torch.nn.Module) -> str | None:
    """The dotted path of the deepest module whose code raised `exc` ("" for the root), or
    None when no module's frame is on the traceback."""
    names = {id(m): path for path, m in model.named_modules()}
    found: str | None = None
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and id(owner) in names:
            found = names[id(owner)]
        tb = tb.tb_next
    if found is None and exc.__cause__ is not None and exc.__cause__ is not exc:
        return failing_submodule(exc.__cause__, model)
    return found


def rewrite_kept(gm: torch.fx.GraphModule, reasons: dict[str, str]) -> None:
    """Each `call_module` of a kept module -> a `KeptModule` call on its state's get_attrs."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        path = str(node.target)
        module = gm.get_submodule(path)
        with graph.inserting_before(node):
            state = {name: graph.get_attr(f"{path}.{name}")
                     for name, _ in [*module.named_parameters(remove_duplicate=False),
                                     *module.named_buffers(remove_duplicate=False)]}
            call = graph.call_function(KeptModule(module, path, reasons.get(path, "")), (state, *node.args),
                                       dict(node.kwargs))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
