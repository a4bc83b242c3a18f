"""Emit the generated package DIR: stage sources, manifest.json, plan.txt, __init__.py.

The package is written into a temporary folder beside DIR and renamed into place, so a
failure never leaves half a package (and an old package is replaced whole).  Output is
deterministic: the same graph, plan and info give the same bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.passes.shape_prop import TensorMetadata

from partitioner.ir import REPLICATED, Layout, Plan
from partitioner.trace.passes import get_attr, node_module
from runtime.manifest import (FORMAT_VERSION, MODEL_COPY, BufferSpec, Manifest, Mesh, ModelInput, ParamSpec, Predicted,
                              Shard, Source, StageInput, StageOutput, StageSpec, TiedParameter)

from .copies import model_copies
from .layout import StageLayout, lay_out
from .names import attr_name, attr_names, group, module_roots, value_names
from .report import format_kept, format_plan
from .source import BATCH, MODEL_FILE, EmitError, StageSource, batch_dim, uses_batch

__all__ = ["PackageInfo", "emit", "FORMAT_VERSION"]

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
    inputs: list[dict[str, Any]]  # name, key, batch_dim, shape, dtype (per microbatch)
    out_spec: pytree.TreeSpec
    output_leaves: list[Any]
    persistent: set[str]  # original state_dict keys (buffers there are persistent)
    aliases: dict[str, str] = field(default_factory=dict)  # extra key -> canonical name
    unused: dict[str, torch.Tensor] = field(default_factory=dict)  # original tensors no node reads
    unused_params: set[str] = field(default_factory=set)
    predicted: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    tp: int = 1
    shards: dict[str, Layout] = field(default_factory=dict)  # parameter -> its tensor-parallel layout
    tensor_parallel: dict[str, Any] = field(default_factory=dict)  # the manifest's block (rules, collectives)
    recompute: bool = False  # every stage runs its forward again in backward (the stages' "recompute")
    free_batch: bool = False  # sizes that follow the batch are read from the inputs ([Note: free batch])
    #: each output leaf's batch dimension ([Note: input leaves] in partitioner/trace/inputs.py)
    output_batch_dims: tuple[int | None, ...] = ()
    precision: str = "fp32"  # runtime.precision ([Note: mixed precision])
    source_text: bytes = b""  # the model file's bytes, copied into the package as MODEL_COPY
    source_modules: dict[str, bytes] = field(default_factory=dict)  # `<name>.py` of its folder it imports


def emit(out: str | Path, gm: torch.fx.GraphModule, plan: Plan, info: PackageInfo) -> dict[str, Any]:
    """Write the package for `plan` into `out`; return the manifest as its JSON object."""
    layouts = lay_out(gm.graph, plan.stage_of(), plan.num_stages)
    if info.free_batch and any(_batch_input(layout) is None for layout in layouts if uses_batch(layout.nodes)):
        info = dataclasses.replace(info, free_batch=False)  # a stage could not read the batch: fixed for all
    values = value_names(gm.graph, [*module_roots(info.out_spec), BATCH])
    tensors = _attr_tensors(gm, info)
    copies = model_copies(info.source_text, info.source_modules)
    files = dict(copies)
    stages = []
    for layout in layouts:
        entry, source = _stage(layout, gm, plan, info, tensors, values)
        stages.append(entry)
        files[f"{entry.module}.py"] = source.encode()
    constants = {
        b.source_name: tensors[b.source_name] for s in stages for b in s.buffers
    }
    if constants:
        files["constants.pt"] = _save(dict(sorted(constants.items())))
    manifest = _manifest(plan, info, stages, tuple(n for n in copies if n != MODEL_COPY))
    manifest = dataclasses.replace(manifest, hash=_hash(manifest.to_dict(), files))
    files["manifest.json"] = manifest.to_json().encode()
    sources = [files[f"{s.module}.py"].decode() for s in stages]
    files["plan.txt"] = (format_plan(manifest) + format_kept(sources)).encode()
    files["__init__.py"] = _INIT.format(source=Path(info.source_path).name).encode()
    _write_atomically(Path(out), files)
    return manifest.to_dict()


# -- one stage ---------------------------------------------------------------------------


def _stage(
    layout: StageLayout, gm: torch.fx.GraphModule, plan: Plan, info: PackageInfo, tensors: dict[str, torch.Tensor],
    values: dict[torch.fx.Node, str],
) -> tuple[StageSpec, str]:
    k, last = layout.index, layout.index == plan.num_stages - 1
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    held = [str(a.target) for a in layout.attrs]
    if k == 0:
        held += sorted(info.unused)
    attrs = {n: attr_name(n) for n in held} | attr_names(layout, info.aliases)
    param_entries = [_param(n, tensors[n], info.shards.get(n, REPLICATED), info.tp, attrs[n])
                     for n in held if n in params or n in info.unused_params]
    buffer_entries = [
        _buffer(n, tensors[n], n in info.persistent, attrs[n]) for n in held if not (n in params or n in info.unused_params)
    ]
    names = {n: values[n] for n in layout.inputs + layout.nodes}
    names.update({a: f"self.{attrs[str(a.target)]}" for a in layout.attrs})
    batch = _batch_name(set(names.values())) if info.free_batch else ""
    writer = StageSource(imports=set(), batch=batch, device=_device_expr(layout, names))
    body = [f"        {line}" for line in _clone_written_inputs(layout, names) + writer.statements(layout.nodes, names)]
    if info.free_batch and uses_batch(layout.nodes):
        body.insert(0, f"        {_read_batch(layout, names, k, writer.batch)}")
    if last:
        body.append(f"        return {writer.build_output(info.out_spec, info.output_leaves, names)}")
    else:
        outs = ", ".join(names[n] for n in layout.outputs)
        body.append(f"        return ({outs},)" if len(layout.outputs) == 1 else f"        return ({outs})")
    entry = StageSpec(
        index=k,
        module=f"stage_{k}",
        class_name=f"Stage{k}",
        ranks=tuple(_ranks(k, plan)),
        inputs=tuple(_boundary_in(n, names[n], plan, info.free_batch) for n in layout.inputs),
        outputs=(StageOutput("output", None, None, "output", True),) if last
        else tuple(_boundary_out(n, names[n], layout.consumers[n], info.free_batch) for n in layout.outputs),
        parameters=tuple(param_entries),
        buffers=tuple(buffer_entries),
        nodes=len(layout.nodes),
        modules=tuple(_modules(layout.nodes)),
        recompute=info.recompute,
    )
    return entry, _render(entry, layout, plan, info, writer, body)


def _clone_written_inputs(layout: StageLayout, names: dict[torch.fx.Node, str]) -> list[str]:
    """`x = x.clone()` for each input the stage writes in place (`x += y`, `relu_`): a
    stage input is an autograd leaf, which in-place ops may not touch ([Note: in-place ops]
    in partitioner/trace/passes.py)."""
    written = {w for n in layout.nodes for w in n.meta.get("writes", ())}
    return [f"{names[x]} = {names[x]}.clone()  # written in place below" for x in layout.inputs if x.name in written]


def _render(entry: StageSpec, layout: StageLayout, plan: Plan, info: PackageInfo, writer: StageSource, body: list[str]) -> str:
    k, S = layout.index, plan.num_stages
    stage_plan = plan.stages[k]
    rows = info.batch_size // (plan.microbatches * plan.dp)
    header = [
        f"# Generated by {GENERATOR}; do not edit: recompile the model file instead.",
        f"# model: {Path(info.source_path).name} (sha256 {info.source_sha256[:16]}), {info.entry}(), seed {info.seed}, traced with {info.tracer}",
        f"# plan:  stage {k} of {S} (pp={plan.pp} tp={plan.tp} dp={plan.dp}), {plan.schedule}, "
        f"{plan.microbatches} microbatches of {rows} rows",
        f"# stage: {_count(entry.nodes, 'node')} ({', '.join(entry.modules) or 'no modules'})",
        f"# time:  {stage_plan.time_s * 1e3:.3f} ms predicted for one microbatch: forward+backward"
        f"{' (the forward twice)' if info.recompute else ''} with its messages",
    ]
    last = k == S - 1
    lines = header + ["", "from __future__ import annotations", ""] + _imports(writer, bool(entry.buffers), last)
    if "aten" in writer.imports:
        lines += ["aten = torch.ops.aten", ""]
    lines += _model_file_line(writer)
    lines += ["", f"class Stage{k}(torch.nn.Module):", f'    """Stage {k} of {S}: {_summary(entry)}."""', ""]
    lines += ["    def __init__(self) -> None:", "        super().__init__()"]
    lines += _parameter_lines(entry.parameters, info.aliases)
    lines += _kept_lines(writer)
    if entry.buffers:
        lines.append("        constants = _constants()")
    for b in entry.buffers:
        flag = "" if b.persistent else ", persistent=False"
        lines.append(f"        self.register_buffer({b.name!r}, constants[{b.source_name!r}]{flag})")
    args = "".join(f", {spec.name}: torch.Tensor" for spec in entry.inputs)
    returns = "Any" if last else "tuple[torch.Tensor, ...]"
    lines += ["", f"    def forward(self{args}) -> {returns}:"] + body
    if entry.buffers:
        lines += ["", "", "def _constants() -> dict[str, torch.Tensor]:",
                  '    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "constants.pt")',
                  "    return torch.load(path, weights_only=True)"]
    return "\n".join(lines) + "\n"


def _kept_lines(writer: StageSource) -> list[str]:
    """`self.<attr> = kept_module(__file__, "<path>")` per user module the stage keeps whole."""
    return [f"        self.{attr} = kept_module(__file__, {kept.path!r})  # kept whole: {kept.reason}"
            for attr, kept in sorted(writer.kept.items())]


def _model_file_line(writer: StageSource) -> list[str]:
    """`model = model_file_of(__file__)` when the stage calls code of the model file itself."""
    if MODEL_FILE not in writer.imports:
        return []
    return ["model = model_file_of(__file__)  # the model file this package was compiled from", ""]


def _imports(writer: StageSource, constants: bool, last: bool) -> list[str]:
    """The stage's imports in isort's groups: the standard library, then torch and others."""
    stdlib = (["import os"] if constants else []) + (["from typing import Any"] if last else [])
    others = sorted(i for i in writer.imports if i.startswith("import ") and i != "import torch")
    third = ["import torch"] + (["import torch.nn.functional as F"] if "F" in writer.imports else []) + others
    ours = sorted(i for i in writer.imports if i.startswith("from runtime"))
    ours = ([""] + ours) if ours else []
    return (stdlib + [""] if stdlib else []) + third + ours + [""]


# -- manifest entries --------------------------------------------------------------------


def _manifest(plan: Plan, info: PackageInfo, stages: list[StageSpec], modules: tuple[str, ...]) -> Manifest:
    """The manifest without its hash (which covers the manifest itself); `modules`: those of
    the model file's folder copied beside it."""
    tied: dict[str, list[int]] = {}
    for s in stages:
        for p in s.parameters:
            tied.setdefault(p.source_name, []).append(s.index)
    return Manifest(
        format_version=FORMAT_VERSION,
        generator=GENERATOR,
        source=Source(Path(info.source_path).name, info.source_sha256, info.entry, info.seed, MODEL_COPY, modules),
        tracer=info.tracer,
        options=info.options,
        mesh=Mesh(plan.pp, plan.tp, plan.dp),
        schedule=plan.schedule,
        microbatches=plan.microbatches,
        virtual_stages=plan.virtual_stages,
        batch_size=info.batch_size,
        free_dims=("batch",) if info.free_batch else (),
        output_batch_dims=info.output_batch_dims if any(d not in (0, None) for d in info.output_batch_dims) else (),
        precision=info.precision,
        inputs=tuple(_model_input(i) for i in info.inputs),
        stages=tuple(stages),
        tied_parameters=tuple(TiedParameter(n, tuple(s)) for n, s in tied.items() if len(s) > 1),
        state_dict_aliases=dict(sorted(info.aliases.items())),
        meta_constants=tuple(sorted(b.source_name for s in stages for b in s.buffers if b.meta)),
        tensor_parallel=info.tensor_parallel,
        predicted=Predicted.from_dict(info.predicted) if info.predicted else None,
    )


def _model_input(i: dict[str, Any]) -> ModelInput:
    shape = i["shape"]
    return ModelInput(i["name"], i["key"], i["batch_dim"], None if shape is None else tuple(shape), i["dtype"])


def _ranks(stage: int, plan: Plan) -> list[int]:
    """Global rank = (replica * pp + pipeline position) * tp + tensor-parallel index; stage s
    sits at position `plan.rank_of(s)`, s % pp or a V under zb-v (tensor-parallel ranks are
    neighbours, as NVLink peers are)."""
    return [(r * plan.pp + plan.rank_of(stage)) * plan.tp + t for r in range(plan.dp) for t in range(plan.tp)]


def _meta(node: torch.fx.Node) -> tuple[list[int], str, bool]:
    meta = node.meta["tensor_meta"]
    return [int(d) for d in meta.shape], str(meta.dtype).replace("torch.", ""), bool(meta.requires_grad)


def _boundary_in(node: torch.fx.Node, name: str, plan: Plan, free: bool) -> StageInput:
    shape, dtype, grad = _meta(node)
    if node.op == "placeholder":
        return StageInput(name, tuple(shape), dtype, "input", False)
    found = batch_dim(node) if free else None
    return StageInput(name, tuple(shape), dtype, plan.stage_of()[node.name], grad, found[0] if found else None)


def _boundary_out(node: torch.fx.Node, name: str, readers: list[int], free: bool) -> StageOutput:
    shape, dtype, grad = _meta(node)
    found = batch_dim(node) if free else None
    return StageOutput(name, tuple(shape), dtype, tuple(readers), grad, found[0] if found else None)


def _batch_name(taken: set[str]) -> str:
    """`batch`, or the first of `batch_rows`, `batch_rows_1`, ... no value of the stage is named."""
    for name in (BATCH, *(f"{BATCH}_rows" + (f"_{i}" if i else "") for i in range(len(taken) + 1))):
        if name not in taken:
            return name
    raise AssertionError("unreachable: more candidates than names")


def _batch_input(layout: StageLayout) -> tuple[torch.fx.Node, int, int] | None:
    """The first stage input with a batch dimension, its dim and rows per microbatch row
    ([Note: free batch]); None when none has one: a stage that computes sizes from the batch
    without one fixes the package's batch (the solver may place such nodes apart from every
    batch-carrying value)."""
    for node in layout.inputs:
        found = batch_dim(node) if "tensor_meta" in node.meta else None
        if found and found[1] > 0:
            return node, found[0], found[1]
    return None


def _read_batch(layout: StageLayout, names: dict[torch.fx.Node, str], k: int, batch: str) -> str:
    """`batch = x.shape[d]` (or `// coef`): the microbatch's rows, read from an input."""
    found = _batch_input(layout)
    if found is None:
        raise EmitError(f"stage {k} computes sizes from the batch size but none of its inputs has a batch dimension "
                        f"to read it from: compile with a fixed batch (report this model).")
    node, d, coef = found
    rows = f"{names[node]}.shape[{d}]"
    return f"{batch} = {rows}" if coef == 1 else f"{batch} = {rows} // {coef}"


def _param(name: str, t: torch.Tensor, layout: Layout, tp: int, attr: str) -> ParamSpec:
    """A parameter entry; a sharded one has its local shape and `index` "tp": the rank's
    own tensor-parallel index (one stage file serves every rank of the group)."""
    shard = Shard() if layout.replicated else Shard(layout.dim, "tp", tp, layout.blocks)
    return ParamSpec(attr, name, tuple(layout.local_shape(tuple(t.shape), tp)),
                     str(t.dtype).replace("torch.", ""), bool(t.requires_grad), shard)


def _buffer(name: str, t: torch.Tensor, persistent: bool, attr: str) -> BufferSpec:
    return BufferSpec(attr, name, tuple(t.shape), str(t.dtype).replace("torch.", ""), persistent, meta=t.is_meta)


def _device_expr(layout: StageLayout, names: dict[torch.fx.Node, str]) -> str | None:
    """Where the stage's code finds its device.

    [Note: devices in stage code]
        The trace runs on one device (the CPU, or meta with --analytic) and folds every
        `torch.device` it meets into a constant (trace/passes.py `specialize`), so a
        device is a literal in the graph: `arange(8, device=idx.device)` and
        `x.to(dtype=..., device=...)` alike.  No literal device reaches the stage's code:
        every one is written as the device of the stage's first tensor input
        (`device=input_ids.device`), or, with none, of its first parameter or buffer,
        which the runtime moves with the module (`.to(device)`).  A stage therefore
        runs on whatever device its inputs and weights are on.  What this gives up: a
        model that moves a value to another device on purpose (`.cpu()` in the middle of
        a forward on a GPU) runs it on the stage's device instead.  A stage with no tensor
        input and no weights keeps the literal; the fake-GPU check
        (tests/fake_gpu.py) reports it.
    """
    first = next((n for n in layout.inputs if isinstance(n.meta.get("tensor_meta"), TensorMetadata)), None)
    if first is None and layout.attrs:
        first = layout.attrs[0]
    return None if first is None else f"{names[first]}.device"


def _attr_tensors(gm: torch.fx.GraphModule, info: PackageInfo) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = dict(info.unused)
    out.update({str(n.target): get_attr(gm, str(n.target)) for n in gm.graph.nodes if n.op == "get_attr"})
    return out


def _modules(nodes: list[torch.fx.Node]) -> list[str]:
    """The modules a stage's nodes come from, down to the layer index (`transformer.h.3`)."""
    seen: list[str] = []
    for n in nodes:
        parts = node_module(n).split(".")
        layer = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        name = ".".join(parts[: layer + 1] if layer is not None else parts[:2])
        if name and name not in seen:
            seen.append(name)
    return seen


def _summary(entry: StageSpec) -> str:
    mods = entry.modules
    shown = ", ".join(mods[:6]) + (f" and {len(mods) - 6} more" if len(mods) > 6 else "")
    return f"{shown or 'top-level ops'} ({_count(entry.nodes, 'node')})"


def _count(n: int, noun: str) -> str:
    """`1 node`, `2 nodes`."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _parameter_lines(params: tuple[ParamSpec, ...], aliases: dict[str, str]) -> list[str]:
    """One line per parameter, those of one layer under a `# <layer>` line (`names.group`),
    the origin written out only where the name does not say it."""
    lines: list[str] = []
    current, in_layer = None, False
    for p in params:
        key = next((k for k in (p.source_name, *sorted(aliases)) if attr_name(k) == p.name), p.source_name)
        module = key.rpartition(".")[0]
        layer = group(module) != module
        if group(module) != current and (layer or in_layer):
            lines += [""] if lines else []
        if group(module) != current and layer:
            lines.append(f"        # {group(module)}")
        current, in_layer = group(module), layer
        origin = _origin(p, aliases)
        comment = f"  # {origin}" if origin else ""
        lines.append(f"        self.{p.name} = torch.nn.Parameter({_zeros(p)}{_grad(p)}){comment}")
    return lines


def _origin(p: ParamSpec, aliases: dict[str, str]) -> str:
    """Where a parameter comes from when its name does not say it: `lm_head.weight` for an
    attribute named otherwise, `= lm_head.weight` for a tied one named after another of its
    keys; '' when the name is the state_dict key's."""
    if attr_name(p.source_name) == p.name:
        return ""
    key = next((k for k, c in sorted(aliases.items()) if c == p.source_name and attr_name(k) == p.name), None)
    return p.source_name if key is None else f"= {p.source_name}"


def _zeros(p: ParamSpec) -> str:
    dims = ", ".join(str(d) for d in p.shape)
    dtype = "" if p.dtype == "float32" else f", dtype=torch.{p.dtype}"
    return f"torch.zeros({dims}{dtype})" if dims else f"torch.zeros((){dtype})"


def _grad(p: ParamSpec) -> str:
    return "" if p.requires_grad else ", requires_grad=False"


# -- files -------------------------------------------------------------------------------


def _save(tensors: dict[str, torch.Tensor]) -> bytes:
    """constants.pt, from the CPU whatever device the compile ran the model on; tensors built
    on the meta device have no values and are saved as zeros (persistent buffers are loaded
    from the state_dict anyway; the manifest says which)."""
    buffer = io.BytesIO()
    real = {k: torch.zeros(v.shape, dtype=v.dtype) if v.is_meta else v.detach().cpu().clone().contiguous()
            for k, v in tensors.items()}
    torch.save(real, buffer)
    return buffer.getvalue()


def _hash(manifest: dict[str, Any], files: dict[str, bytes]) -> str:
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode())
    for name in sorted(files):
        digest.update(name.encode() + files[name])
    return digest.hexdigest()


def _write_atomically(out: Path, files: dict[str, bytes]) -> None:
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_INIT = '''"""A pipeline package generated by partitioner from {source}.

    import runtime
    pipe = runtime.LocalPipeline(<this folder>)     # or runtime.DistributedPipeline
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))

with open(os.path.join(_HERE, "manifest.json")) as _f:
    MANIFEST: dict[str, Any] = json.load(_f)


def load_stage(index: int) -> torch.nn.Module:
    """A fresh instance of Stage<index> (parameters zero until load_state_dict)."""
    stage = MANIFEST["stages"][index]
    path = os.path.join(_HERE, stage["module"] + ".py")
    spec = importlib.util.spec_from_file_location(f"{{__name__}}.{{stage['module']}}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, stage["class"])()
'''
