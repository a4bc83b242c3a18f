"""The model's output as leaves and a structure, whatever class holds it.

[Note: output classes]
    A model may return its own class: a NamedTuple, a @dataclass, a Hugging Face
    `ModelOutput` subclass, defined in the model file, in a module beside it or in a
    library.  The pipeline returns that class (pipe(inputs), and what `loss_fn` receives):

    - Tracing: both tracers describe the output by a pytree `TreeSpec` over its tensor
      leaves (`Traced.out_spec`), taken from the very object forward() returns: fx's
      tracer flattens it before fx turns it into graph arguments (which would make a
      NamedTuple or a dataclass a constructor call, and a ModelOutput a plain dict), and
      export flattens it itself.  A dataclass pytree does not know is registered as a
      pytree node of its fields (`runtime.outputs.register_output`), at any depth of the
      output, before either flattens it.
    - Code: the last stage rebuilds the output from the spec (codegen/source.py
      `StageSource.build_output`), naming the class as the stage names any class of the
      user's: `model.<Name>` for one of the model file, read from the package's own copy
      (`runtime.package.model_file_of`), never the compile-time module
      `_partitioner_model_<hash>`; `<module>.<Name>` imported otherwise (a module of the
      model's folder is copied into the package and found there).  A dataclass is
      registered again at run time by the stage file (`register_output(model.Out)`).
    - Run time: the package's model file is imported once per process (runtime/model_file.py
      `load_model_file`), so the stages and the model file's `loss_fn` see one class; the
      runtime joins microbatch outputs, moves them between devices and casts them with
      pytree, which now knows the class.  The outputs a DistributedPipeline gathers from
      the last stage's ranks name a model file's class by its name in the file, read on
      each rank from its own import (`runtime.outputs.all_gather`).  A script that calls
      `partitioner.parallelize` has its copy in the package imported as the script itself
      (`runtime.model_file.share_running_script`), so its classes are the script's own.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.utils._pytree as pytree

from runtime.outputs import register_classes

__all__ = ["output_tree", "registering_outputs"]


def output_tree(value: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """The leaves and structure of an output `value`, its dataclasses registered first."""
    register_classes(value)
    return pytree.tree_flatten(value)


@contextlib.contextmanager
def registering_outputs(model: torch.nn.Module) -> Iterator[None]:
    """While the body runs, a call of `model` registers the dataclasses of its output (for
    torch.export, which flattens the output as soon as forward returns)."""
    handle = model.register_forward_hook(lambda _module, _args, output: register_classes(output))
    try:
        yield
    finally:
        handle.remove()
