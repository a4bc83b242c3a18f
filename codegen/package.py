"""Emit the generated package DIR: stage sources, manifest.json, plan.txt, __init__.py.

The package is written into a temporary folder and moved into DIR, so a failure never
leaves half a package: DIR is new, empty, or an earlier package, replaced whole; a folder
holding anything else is refused unless forced, and even forced, no file the compiler did
not write is deleted ([Note: output folders] in runtime/outdir.py).  Output is
deterministic: the same graph, plan and info give the same bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from pathlib import Path
from typing import Any

import torch
import torch.fx

from partitioner.errors import PackageError
from partitioner.ir import Plan
from partitioner.trace.passes import get_attr
from runtime import outdir
from runtime.manifest import FORMAT_VERSION, MODEL_COPY, Manifest, Mesh, Source, StageSpec, TiedParameter

from .copies import model_copies
from .info import GENERATOR, PackageInfo
from .layout import lay_out
from .names import module_roots, value_names
from .report import format_kept, format_plan
from .source import BATCH, uses_batch
from .stage import batch_input, stage_entry

__all__ = ["PackageInfo", "emit", "check_out", "earlier_package", "FORMAT_VERSION", "GENERATOR"]


def emit(out: str | Path, gm: torch.fx.GraphModule, plan: Plan, info: PackageInfo, force: bool = False) -> Manifest:
    """Write the package for `plan` into `out`; return its manifest, as manifest.json has it.
    `force`: into a folder that holds other files too, beside them (`check_out`)."""
    layouts = lay_out(gm.graph, plan.stage_of(), plan.num_stages)
    if info.free_batch and any(batch_input(layout) is None for layout in layouts if uses_batch(layout.nodes)):
        info = dataclasses.replace(info, free_batch=False)  # a stage could not read the batch: fixed for all
    values = value_names(gm.graph, [*module_roots(info.out_spec), BATCH])
    tensors = _attr_tensors(gm, info)
    copies = model_copies(info.source_text, info.source_modules)
    files = dict(copies)
    stages = []
    for layout in layouts:
        entry, source = stage_entry(layout, gm, plan, info, tensors, values)
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
    check_out(out, force, "--force", writes=set(files))
    outdir.write(Path(out), lambda tmp: _write_files(tmp, files), earlier_package, force=force, last="manifest.json")
    return manifest




# -- manifest ----------------------------------------------------------------------------


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
        loss_reduction=info.loss_reduction,
        inputs=info.inputs,
        stages=tuple(stages),
        tied_parameters=tuple(TiedParameter(n, tuple(s)) for n, s in tied.items() if len(s) > 1),
        state_dict_aliases=dict(sorted(info.aliases.items())),
        meta_constants=tuple(sorted(b.source_name for s in stages for b in s.buffers if b.meta)),
        tensor_parallel=info.tensor_parallel,
        predicted=info.predicted,
    )




def _attr_tensors(gm: torch.fx.GraphModule, info: PackageInfo) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = dict(info.unused)
    out.update({str(n.target): get_attr(gm, str(n.target)) for n in gm.graph.nodes if n.op == "get_attr"})
    return out



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


def _write_files(folder: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (folder / name).write_bytes(data)


# -- the out folder ----------------------------------------------------------------------


def earlier_package(folder: Path) -> set[str] | None:
    """The files of the package partitioner wrote in `folder`, as its manifest.json lists
    them (stages, the model file's copies, the fixed files); None when `folder` holds no
    manifest.json that this compiler wrote (no generator stamp, another format, unreadable)."""
    try:
        data = json.loads((folder / "manifest.json").read_text())
        if not str(data["generator"]).startswith(GENERATOR.split()[0] + " "):
            return None
        source = data.get("source") or {}
        modules = [f"{stage['module']}.py" for stage in data["stages"]]
        copies = [str(source["copy"])] if source.get("copy") else []
        names = {"manifest.json", "plan.txt", "__init__.py", "constants.pt", *modules, *copies,
                 *map(str, source.get("modules") or [])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return names if all(outdir.plain(n) for n in names) else None


def check_out(out: str | Path, force: bool, flag: str, writes: set[str] | None = None) -> None:
    """Refuse an out folder the compile would delete or overwrite a file of that it did
    not write ([Note: output folders] in runtime/outdir.py); `flag`: how the caller forces
    (`--force`, `force=True`)."""
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise PackageError(f"the out folder {str(out)!r} is a file, not a folder: give a new folder for the package.")
    blocking = outdir.in_the_way(folder, earlier_package, force, writes)
    if blocking:
        raise PackageError(outdir.refusal(f"the out folder {str(out)!r}", blocking, force, output="package",
                                          writer="the compiler", flag=flag))


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
