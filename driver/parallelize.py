"""`partitioner.parallelize(model, example_inputs, loss_fn, *, out=None, **options)`: the
user's own `nn.Module`, built in the script, compiled into a package and returned as a
pipeline (docs/from-your-script.md).

    1. key      the cache key of the model, example shapes, options, hardware
                ([Note: the parallelize cache key] in driver/keywords.py)
    2. package  the package in `out` (default: the cache folder named by the key) reused
                when its key is this one, else compiled there: the model recorded as a model
                file (driver/recorded.py), then the compile of the command line
                (driver.compile.compile_model), given the example batch as it is
    3. agree    under torchrun, rank 0 does 2 while the others wait for its word
                ([Note: one rank compiles])
    4. pipeline runtime.DistributedPipeline on every rank, or runtime.LocalPipeline in one
                process, given the model's own values unless it is on the meta device
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

from codegen.package import check_out
from partitioner.errors import PackageError, ParallelizeError
from partitioner.trace.model_file import split_example
from runtime.pipeline import Pipeline

from .compile import compile_model
from .keywords import cache_key, compile_options
from .phases import load_source
from .recorded import record

__all__ = ["cache_folder", "parallelize"]

#: how long the other ranks wait for rank 0's compile (env PARTITIONER_COMPILE_TIMEOUT_S)
COMPILE_TIMEOUT_S = 1800.0
_KEY_LINE = re.compile(r"^KEY = '([0-9a-f]{64})'", re.MULTILINE)


def parallelize(model: torch.nn.Module, example_inputs: Any, loss_fn: Callable[..., Any] | None = None, *,
                out: str | Path | None = None, engine: str | None = None, **options: Any) -> Pipeline:
    """The pipeline of `model`, compiled with the command line's `options` (phases above);
    `example_inputs`: one whole batch, a tuple of positional arguments, a dict of keyword
    arguments or one tensor."""
    example = _as_args(example_inputs)
    key = cache_key(model, example, loss_fn, options)  # 1. key
    folder = Path(out) if out is not None else cache_folder(model, key)
    if _distributed():  # 3. agree, around 2. package
        folder = _agreed(lambda: _package(model, example, loss_fn, folder, key, options))
        pipe = _distributed_pipeline(folder, engine)
    else:
        _package(model, example, loss_fn, folder, key, options)
        pipe = _local_pipeline(folder, engine)
    if not _on_meta(model):  # 4. the model's own values, each rank its own shards
        pipe.load_state_dict(model.state_dict())
    return pipe


def cache_folder(model: torch.nn.Module, key: str) -> Path:
    """`$PARTITIONER_CACHE/parallelize/<Model>-<key>` (default cache: ~/.cache/partitioner)."""
    root = Path(os.environ.get("PARTITIONER_CACHE") or Path.home() / ".cache" / "partitioner")
    return root / "parallelize" / f"{type(model).__name__}-{key[:16]}"


def _as_args(example: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example batch as (args, kwargs), as a model file's example_inputs() is read."""
    split = split_example(example)
    if split is not None:
        return split
    raise ParallelizeError(f"parallelize() got example_inputs of type {type(example).__name__}: give one whole batch "
                           f"as a tuple of positional arguments, a dict of keyword arguments, or a tensor.")


def _package(model: torch.nn.Module, example: tuple[tuple[Any, ...], dict[str, Any]],
             loss_fn: Callable[..., Any] | None, folder: Path, key: str, options: dict[str, Any]) -> Path:
    """2. package: `folder` reused when it holds this key's package, else compiled into."""
    if _key_of(folder) == key:
        print(f"parallelize: reusing the package in {folder} (same model, example shapes, options and hardware; "
              f"no compile)", file=sys.stderr)
        return folder
    _check_writable(folder, bool(options.get("force")))
    recorded = record(model, loss_fn, key)
    with tempfile.TemporaryDirectory(prefix="parallelize-") as staging:
        opts = compile_options(str(recorded.write(Path(staging))), str(folder), _meta(model, options))
        compile_model(opts, source=load_source(opts, example=example))
    return folder


def _check_writable(folder: Path, force: bool) -> None:
    """`folder` is new, empty or an earlier package, or `force` is given: the command line's
    check ([Note: output folders] in runtime/outdir.py), raised as parallelize's error."""
    try:
        check_out(folder, force, "force=True")
    except PackageError as exc:
        raise ParallelizeError(str(exc)) from None


def _key_of(folder: Path) -> str | None:
    """The cache key a package was written for (its model file's KEY), or None."""
    copy, manifest = folder / "model_file.py", folder / "manifest.json"
    if not (copy.is_file() and manifest.is_file()):
        return None
    found = _KEY_LINE.search(copy.read_text(errors="replace"))
    return found.group(1) if found else None


def _meta(model: torch.nn.Module, options: dict[str, Any]) -> dict[str, Any]:
    """The options, with `meta=True` for a model on the meta device (nothing to run)."""
    return options | {"meta": True} if _on_meta(model) and options.get("meta") is None else options


def _on_meta(model: torch.nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def _distributed() -> bool:
    """Under torchrun (or torch.distributed started by the caller) with more than one rank."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def _agreed(work: Callable[[], Path]) -> Path:
    """[Note: one rank compiles]
        Rank 0 finds or compiles the package while the others wait on a gloo group of
        their own whose timeout is the compile's (PARTITIONER_COMPILE_TIMEOUT_S, default
        30 minutes), not the pipeline's; rank 0 then broadcasts the package's folder, or
        its error, which every rank raises.  The folder must be one every rank reads (one
        machine, or a shared file system)."""
    import torch.distributed as dist

    from runtime.comm import init_from_env, timeout_from_env

    init_from_env(timeout_from_env())
    timeout = float(os.environ.get("PARTITIONER_COMPILE_TIMEOUT_S") or COMPILE_TIMEOUT_S)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    word: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            word = [("ok", str(work()))]
        except Exception as exc:
            word = [("error", f"{type(exc).__name__}: {exc}")]
            dist.broadcast_object_list(word, src=0, group=group)
            raise
    try:
        dist.broadcast_object_list(word, src=0, group=group)
    except Exception as exc:
        raise ParallelizeError(
            f"rank {dist.get_rank()} waited {timeout:g} s for rank 0 to compile or find the package and heard "
            f"nothing ({type(exc).__name__}): rank 0 failed or is still compiling; see its output, or raise "
            f"PARTITIONER_COMPILE_TIMEOUT_S, or compile ahead and pass out=.") from None
    status, text = word[0]
    if status != "ok":
        raise ParallelizeError(f"rank 0 could not make the package, so rank {dist.get_rank()} stops too: {text}")
    return Path(text)


def _distributed_pipeline(folder: Path, engine: str | None) -> Pipeline:
    from runtime import DistributedPipeline  # through the package: every engine registered

    return DistributedPipeline(folder, **_engine(DistributedPipeline, engine))


def _local_pipeline(folder: Path, engine: str | None) -> Pipeline:
    from runtime.local import LocalPipeline

    return LocalPipeline(folder, **_engine(LocalPipeline, engine))


def _engine(cls: type, engine: str | None) -> dict[str, Any]:
    """`engine=` for a pipeline class that takes it; an error where it does not."""
    if engine is None:
        return {}
    if "engine" not in inspect.signature(cls).parameters:
        raise ParallelizeError(f"engine={engine!r}: {cls.__name__} takes no engine (it runs its own schedules): "
                               f"leave engine= out, or run under torchrun for DistributedPipeline's engines.")
    return {"engine": engine}
