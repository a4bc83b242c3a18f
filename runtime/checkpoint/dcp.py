"""save_checkpoint / load_checkpoint in torch.distributed.checkpoint's format (the user-facing
contract: docs/checkpoints.md).

A checkpoint PATH is two DCP checkpoints:

    PATH/            the model: the ORIGINAL state_dict's keys (aliases included), full
                     global shapes ([Note: checkpoint chunks]); dcp_to_torch_save(PATH, F)
                     gives the original model's state_dict
    PATH/train/      optim/NAME/KEY  an optimizer state of parameter NAME: a tensor shaped
                                     like the parameter is stored whole (boxes, as the
                                     parameter), anything else (Adam's step) as an object
                     optim_group/NAME  the hyperparameters of NAME's param group (lr, ...)
                     extra           the caller's `extra` (LR scheduler, step, data position)
                     rng/RANK        each rank's torch RNG states
    PATH/CHECKSUMS.json the sha256 of every file ([Note: checkpoint checksums])
    PATH/COMPLETE.json  written last ([Note: checkpoint commit])

Optimizer state is keyed by original names, so it loads onto any plan; any torch.optim
optimizer whose per-parameter state is tensors shaped like the parameter plus anything
replicated (SGD, momentum, Adam, AdamW, RMSprop, Adagrad, ...) round-trips.
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import signal
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from ..comm import _short
from ..errors import CheckpointError, PipelineError
from ..weights import Held, _expected_keys, key_mismatch
from .. import faults
from . import commit as commits
from . import space
from .chunks import Chunked, boxes, collect, global_shape, is_sharded
from .view import View

__all__ = ["save", "load", "FAULT_ENV"]

FAULT_ENV = "PIPELINE_CHECKPOINT_FAULT"  # test hook: "RANK": that rank SIGKILLs itself mid-save


# -- save -----------------------------------------------------------------------------------


def save(view: View, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None,
         extra: Any = None, keep: int | None = None) -> Path:
    """Write the checkpoint PATH from every rank (collective); returns PATH."""
    final = Path(path)
    coordinator = view.rank == 0
    hooks = faults.from_env()  # test hooks: [Note: injected faults]
    step = extra.get("step") if isinstance(extra, dict) else None
    try:
        tmp = commits.begin(final, coordinator, view.barrier)
        model = _model_state(view)
        _write(view, model, tmp)
        _fault_hook(view.rank)
        hook = (lambda: hooks.at_save(view.rank, step, tmp / "train")) if isinstance(hooks, faults.StepFaults) else None
        _write(view, _train_state(view, optimizer, extra), tmp / "train", hook)
        commits.commit(final, tmp, coordinator, view.barrier,
                       {"world": view.world, "manifest_hash": view.manifest.hash, "model_file": view.model_file(),
                        "entry": view.manifest.source.entry})
        if isinstance(hooks, faults.StepFaults):
            hooks.after_save(view.rank, step, final)
    except PipelineError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        full = space.disk_full(exc)
        if full is not None:  # [Note: a full disk at a save]
            raise space.space_error(final, commits.partial_dir(final), full, coordinator) from None
        raise CheckpointError(f"rank {view.rank} failed saving checkpoint {final} ({_short(exc)}); if another rank "
                              f"stopped, look at its own error. {final} is as it was before this save.") from exc
    if keep is not None and coordinator:
        commits.prune(final.parent, keep)
    return final


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without DCP's warning that one process saves or loads alone: LocalPipeline means it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, calling `hook` first (the save-time faults of runtime/faults.py)."""

    def __init__(self, where: Path, hook: Callable[[], None]) -> None:
        super().__init__(where, sync_files=True)
        self.hook = hook

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.hook()
        return super().write_data(plan, planner)


def _write(view: View, state: dict[str, Any], where: Path, hook: Callable[[], None] | None = None) -> None:
    writer = _Writer(where, hook) if hook else dcp.FileSystemWriter(where, sync_files=True)
    with _quiet():
        dcp.save(state, storage_writer=writer,
                 planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                 no_dist=not view.distributed, process_group=view.group)


def _fault_hook(rank: int) -> None:
    if os.environ.get(FAULT_ENV, "") == str(rank):
        os.kill(os.getpid(), signal.SIGKILL)


def _model_state(view: View) -> dict[str, Any]:
    state: dict[str, Any] = dict(collect(view.held))
    for alias, canonical in view.manifest.state_dict_aliases.items():
        if canonical in state:
            state[alias] = state[canonical]
    return state


def _train_state(view: View, optimizer: torch.optim.Optimizer | None, extra: Any) -> dict[str, Any]:
    state: dict[str, Any] = {f"rng/{view.rank}": _rng_state()}
    if extra is not None:
        state["extra"] = extra
    if optimizer is None:
        return state
    specs, holder = view.specs(), _holder(optimizer)
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            state[f"optim_group/{_spec_of(specs, p).source_name}"] = hyper
    for p in _params(holder):  # the parameters whose state this process keeps ([Note: ZeRO-1 state])
        spec = _spec_of(specs, p)
        for key, value in holder.state.get(p, {}).items():
            _put(state, f"optim/{spec.source_name}/{key}", _state_value(spec, p, key, value))
    return state


def _holder(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that keeps this process's per-parameter state.

    [Note: ZeRO-1 state]
        Under `--zero 1` the pipeline's optimizer is torch's ZeroRedundancyOptimizer: each
        data-parallel replica keeps the state of the parameters it owns in its local
        optimizer (`.optim`).  A save writes each replica's own states, so together the
        replicas write every parameter's state once; a load asks each process for the
        states of the parameters it owns now, on whatever plan, so a checkpoint moves
        between ZeRO-1 and plain optimizers and between dp degrees.  Hyperparameters
        (lr, betas, ...) live in the wrapper's groups, which list every parameter."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _put(state: dict[str, Any], key: str, value: Any) -> None:
    """state[key] = value, the boxes of a Chunked joined with those already there (the
    lanes of a LocalPipeline hold several shards of one tensor)."""
    held = state.get(key)
    if isinstance(value, Chunked) and isinstance(held, Chunked):
        held.hold(value._boxes)
    else:
        state[key] = value


def _spec_of(specs: dict[int, Held], p: torch.Tensor) -> Held:
    spec = specs.get(id(p))
    if spec is None:
        raise CheckpointError(f"the optimizer holds a tensor of shape {list(p.shape)} that is not a parameter of this "
                              f"pipeline: build it over pipe.parameters().")
    return spec


def _state_value(spec: Held, p: torch.Tensor, key: str, value: Any) -> Any:
    """A parameter-shaped state tensor as boxes (resharded on load); anything else as is."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == p.shape:
        return Chunked(global_shape(spec, p.shape), boxes(spec, value.detach()))  # merged with other lanes' below
    if isinstance(value, torch.Tensor) and value.dim() > 0 and is_sharded(spec):
        raise CheckpointError(f"optimizer state {key!r} of {spec.source_name} has shape {list(value.shape)}, neither "
                              f"the parameter's shard {list(p.shape)} nor a scalar, so it cannot be resharded: use an "
                              f"optimizer whose state is shaped like its parameters (SGD, Adam, AdamW, ...).")
    return {"object": value}  # stored whole as an object (device and dtype kept), never resharded


def _rng_state() -> dict[str, Any]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda, "python": random.getstate()}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])


# -- load -----------------------------------------------------------------------------------


def load(view: View, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None,
         strict: bool = True) -> Any:
    """Read a checkpoint of `save` into this process's tensors (and `optimizer`); restore this
    rank's RNG; return the saved `extra` (None if there was none)."""
    root = Path(path)
    commits.verify(root)
    commits.check_checksums(root)  # before any tensor is read ([Note: checkpoint checksums])
    try:
        _read(view, _model_request(view, root, _metadata(root), strict), root)
        extra = _load_train(view, root / "train", optimizer)
    except PipelineError:
        raise
    except Exception as exc:
        raise CheckpointError(f"checkpoint {root} could not be read ({_short(exc)}): it is corrupt, or another "
                              f"rank stopped (look at its own error); load an earlier checkpoint.") from exc
    return extra


def _metadata(where: Path) -> Metadata:
    try:
        return dcp.FileSystemReader(where).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"checkpoint {where} is corrupt: {where / '.metadata'} cannot be read ({_short(exc)}): "
                              f"load an earlier checkpoint.") from None


def _read(view: View, state: dict[str, Any], where: Path) -> None:
    with _quiet():
        dcp.load(state, storage_reader=dcp.FileSystemReader(where),
                 planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                 no_dist=not view.distributed, process_group=view.group)
    for value in state.values():
        if isinstance(value, Chunked):
            value.fill_copies()


def _model_request(view: View, root: Path, meta: Metadata, strict: bool) -> dict[str, Any]:
    """This process's boxes of every tensor the checkpoint has; missing, unexpected and
    mis-shaped tensors named."""
    stored = meta.state_dict_metadata
    keys = _expected_keys(view.manifest)
    wrong = key_mismatch(stored.keys(), view.manifest, strict)
    if wrong:
        raise CheckpointError(f"checkpoint {root} does not match the package's model ({wrong.describe()}): load a "
                              f"checkpoint of the model the package was compiled from"
                              f"{'' if wrong.unexpected else ', or pass strict=False to leave the missing ones as they are'}.")
    request: dict[str, Any] = {}
    for name, chunked in collect(view.held).items():
        key = next((n for n in keys[name] if n in stored), None)
        if key is None:
            continue
        md = stored[key]
        if not isinstance(md, TensorStorageMetadata) or md.size != chunked.shape:
            got = list(md.size) if isinstance(md, TensorStorageMetadata) else "an object"
            raise CheckpointError(f"checkpoint {root}: {key} is {got} but the model's {name} has shape "
                                  f"{list(chunked.shape)}: load a checkpoint of the model the package was compiled from.")
        request[key] = chunked
    return request


def _load_train(view: View, where: Path, optimizer: torch.optim.Optimizer | None) -> Any:
    stored = _metadata(where).state_dict_metadata
    request: dict[str, Any] = {k: None for k in ("extra", f"rng/{view.rank}") if k in stored}
    fresh: dict[int, dict[str, torch.Tensor]] = {}
    if optimizer is not None:
        specs = view.specs()
        for p in _params(optimizer):
            name = _spec_of(specs, p).source_name
            if f"optim_group/{name}" in stored:
                request[f"optim_group/{name}"] = None
        for p in _params(_holder(optimizer)):  # [Note: ZeRO-1 state]
            spec = _spec_of(specs, p)
            mine = fresh.setdefault(id(p), {})
            prefix = f"optim/{spec.source_name}/"
            for key, md in stored.items():
                if not key.startswith(prefix):
                    continue
                if isinstance(md, BytesStorageMetadata):
                    request[key] = None
                    continue
                local = torch.empty(p.shape, dtype=md.properties.dtype, device=p.device)
                mine[key[len(prefix):]] = local
                _put(request, key, Chunked(global_shape(spec, p.shape), boxes(spec, local)))
    _read(view, request, where)
    if optimizer is not None:
        _fill_optimizer(optimizer, view.specs(), request, fresh)
    if f"rng/{view.rank}" in request:
        _set_rng_state(request[f"rng/{view.rank}"])
    return request.get("extra")


def _fill_optimizer(optimizer: torch.optim.Optimizer, specs: dict[int, Held], loaded: dict[str, Any],
                    fresh: dict[int, dict[str, torch.Tensor]]) -> None:
    """Each parameter's state (tensors read into `fresh`, objects from `loaded`) into the
    optimizer that keeps it ([Note: ZeRO-1 state]), and each group's hyperparameters (from
    its first parameter saved with them)."""
    holder = _holder(optimizer)
    for p in _params(holder):
        prefix = f"optim/{specs[id(p)].source_name}/"
        state = {k[len(prefix):]: copy.deepcopy(v["object"]) for k, v in loaded.items()  # each its own (Adam's step += 1)
                 if k.startswith(prefix) and not isinstance(v, Chunked)}
        state.update(fresh.get(id(p), {}))
        if state:
            holder.state[p] = state
        else:
            holder.state.pop(p, None)
    for group in optimizer.param_groups:
        hyper = next((loaded[k] for k in (f"optim_group/{specs[id(p)].source_name}" for p in group["params"])
                      if loaded.get(k) is not None), None)
        if hyper is not None:
            group.update({k: v for k, v in hyper.items() if k != "params"})
