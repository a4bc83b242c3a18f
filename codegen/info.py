"""What codegen is told about a package's origin beside the graph and the plan
(`PackageInfo`, filled in by driver/package_info.py), and the generator's name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from partitioner.ir import Layout
from runtime.manifest import ModelInput, Predicted

__all__ = ["GENERATOR", "PackageInfo"]

GENERATOR = "partitioner 0.1.0"


@dataclass
class PackageInfo:
    """What the package records about its origin, beside the graph and the plan."""

    source_path: str  # the model file's base name ([Note: the model file's copy])
    source_sha256: str
    entry: str
    seed: int
    tracer: str
    batch_size: int
    inputs: tuple[ModelInput, ...]  # shapes per microbatch
    out_spec: pytree.TreeSpec
    output_leaves: list[Any]
    persistent: set[str]  # original state_dict keys (buffers there are persistent)
    aliases: dict[str, str] = field(default_factory=dict)  # extra key -> canonical name
    unused: dict[str, torch.Tensor] = field(default_factory=dict)  # original tensors no node reads
    unused_params: set[str] = field(default_factory=set)
    predicted: Predicted | None = None  # the planner's prediction (manifest.json's `predicted`)
    options: dict[str, Any] = field(default_factory=dict)
    tp: int = 1
    shards: dict[str, Layout] = field(default_factory=dict)  # parameter -> its tensor-parallel layout
    tensor_parallel: dict[str, Any] = field(default_factory=dict)  # the manifest's block (rules, collectives)
    recompute: bool = False  # every stage runs its forward again in backward (the stages' "recompute")
    offload: tuple[float, ...] = ()  # each stage's share of its activations offloaded (the stages' "offload")
    free_batch: bool = False  # sizes that follow the batch are read from the inputs ([Note: free batch])
    #: each output leaf's batch dimension ([Note: input leaves] in partitioner/trace/inputs.py)
    output_batch_dims: tuple[int | None, ...] = ()
    precision: str = "fp32"  # runtime.precision ([Note: mixed precision])
    loss_reduction: str = "mean"  # how loss_fn reduces over the batch (driver/loss_check.py)
    source_text: bytes = b""  # the model file's bytes, copied into the package as MODEL_COPY
    source_modules: dict[str, bytes] = field(default_factory=dict)  # `<name>.py` of its folder it imports

