"""Initial weights that do not depend on the plan: `init_weights(model, seed)` on an unsplit model
and `pipe.init_weights(seed)` on a pipeline give every parameter the same values.

[Note: mesh-invariant init]
    A parameter's initial value depends on its original name and the seed only: its
    owning module (of the original model, built on the meta device, so nothing is
    allocated) has its OWN parameters materialised on the CPU, filled with NaN, then
    initialised under torch.manual_seed(hash(seed, name)) by, in this order, the model
    file's `init_weights(module)`, the model's own `_init_weights(module)` (Hugging Face)
    and the module's `reset_parameters()`, each run only while a parameter of the module
    is still NaN, and none overwriting what an earlier one set (so a model file's
    `init_weights` may cover just the bare parameters the others do not know); the named
    parameter's value is taken (a NaN left means none of them covered it: an error naming
    it and the fix) and each holder takes its shard of it (package.load_stage_state).  So
    a rank allocates its own tensors plus, transiently, one module's own parameters (and
    a blocked shard's copy), never the whole model; and the values are those of any other
    plan.  A Hugging Face
    `_init_weights` that initialises a child's parameter from its parent module (GPT-2's
    scaled c_proj) is run on the child only: the values stay mesh-invariant, but differ
    from `from_config`'s for those parameters.

[Note: tied init]
    A parameter tied under several names (GPT-2's `transformer.wte.weight` and
    `lm_head.weight`) is one parameter: it is initialised once, under its FIRST name in
    the original model's `named_parameters()` order, by that name's module and seed,
    whichever of its names the package or the caller asks for.  So the unsplit model (whose
    `named_parameters()` yields the first name only) and every plan (whose manifest may
    call it by another) agree, on one stage or on several.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Iterable

import torch

from . import modes, package
from .errors import PipelineError
from .manifest import Manifest, ParamSpec

__all__ = ["init_weights", "InitError", "initial_value", "init_held", "init_pipeline", "param_seed", "first_names"]

ModuleInit = Callable[[torch.nn.Module], Any]


class InitError(PipelineError):
    """A parameter that no initialiser covers."""


def param_seed(seed: int, name: str) -> int:
    """The RNG seed of parameter `name` (stable across processes and Python runs)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _initialisers(model: torch.nn.Module, model_init: ModuleInit | None) -> list[Callable[[torch.nn.Module], bool]]:
    """The initialisers tried on a module, in order ([Note: mesh-invariant init]): the model
    file's, the model's own `_init_weights`, the module's `reset_parameters()`; each says
    whether it applies to the module."""
    own = getattr(model, "_init_weights", None)
    chain = [_always(f) for f in (model_init, own) if callable(f)]
    return [*chain, _reset_parameters]


def _always(init: ModuleInit) -> Callable[[torch.nn.Module], bool]:
    def run(module: torch.nn.Module) -> bool:
        init(module)
        return True

    return run


def _reset_parameters(module: torch.nn.Module) -> bool:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()
    return callable(reset)


def _initialise(owner: torch.nn.Module, fresh: dict[str, torch.nn.Parameter],
                initialisers: list[Callable[[torch.nn.Module], bool]]) -> bool:
    """Run `initialisers` on `owner` in turn while one of its parameters (`fresh`, NaN until
    set) is unset; a parameter an earlier one set keeps that value. Whether any applied."""
    ran = False
    for init in initialisers:
        unset = [n for n, p in fresh.items() if p.isnan().any()]
        if not unset:
            break
        kept = {n: p.detach().clone() for n, p in fresh.items() if n not in unset}
        ran = init(owner) or ran
        for n, value in kept.items():
            fresh[n].copy_(value)
    return ran


def first_names(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter name of `model`, aliases included -> the parameter's first name
    ([Note: tied init])."""
    first: dict[int, str] = {}
    return {name: first.setdefault(id(p), name) for name, p in model.named_parameters(remove_duplicate=False)}


def initial_value(model: torch.nn.Module, name: str, seed: int, model_init: ModuleInit | None = None,
                  names: dict[str, str] | None = None) -> torch.Tensor:
    """Parameter `name`'s initial value (on the CPU) by [Note: mesh-invariant init] and
    [Note: tied init] (`names`: `first_names(model)`, computed when not given); `model` may
    be on the meta device (its owner's own tensors are materialised for the call)."""
    name = (first_names(model) if names is None else names).get(name, name)
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    saved = {n: p for n, p in owner.named_parameters(recurse=False)}
    if attr not in saved:
        raise InitError(f"{name} is not a parameter of the model: compile the model again.")
    fresh = {n: torch.nn.Parameter(torch.full(p.shape, float("nan"), dtype=p.dtype), p.requires_grad)
             for n, p in saved.items()}
    for n, p in fresh.items():
        setattr(owner, n, p)
    try:
        with modes.seeded(param_seed(seed, name), torch.device("cpu")), torch.no_grad():
            ran = _initialise(owner, fresh, _initialisers(model, model_init))
        value = fresh[attr].detach()
    finally:
        for n, p in saved.items():
            setattr(owner, n, p)
    if not ran or value.isnan().any():
        kind = type(owner).__name__
        why = (f"no initialiser ran on its module {owner_name or '(the model)'} ({kind})" if not ran else
               f"the initialisers of its module {owner_name or '(the model)'} ({kind}) left it (partly) unset")
        raise InitError(f"parameter {name} cannot be initialised: {why}. Give {kind} a reset_parameters(), or define "
                        f"init_weights(module) in the model file that initialises every parameter of the module it "
                        f"is given (e.g. `if isinstance(module, {kind}): torch.nn.init.normal_(module.{attr})`).")
    return value


def init_weights(model: torch.nn.Module, seed: int = 0, model_init: ModuleInit | None = None) -> torch.nn.Module:
    """Initialise an UNSPLIT model's parameters in place as `pipe.init_weights(seed)` does
    on any plan of it ([Note: mesh-invariant init]); returns the model."""
    names = first_names(model)
    values = {name: initial_value(model, name, seed, model_init, names) for name, _ in model.named_parameters()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(values[name])
    return model


def init_held(held: Iterable[tuple[package.Held, torch.Tensor]], manifest: Manifest, meta_model: torch.nn.Module,
              seed: int, model_init: ModuleInit | None = None) -> None:
    """Give each held parameter (entries resolved, as stage_tensors gives them) its shard
    of its initial value: one original parameter at a time."""
    by_name: dict[str, list[tuple[package.Held, torch.Tensor]]] = {}
    for spec, tensor in held:
        if isinstance(spec, ParamSpec):
            by_name.setdefault(spec.source_name, []).append((spec, tensor))
    names = first_names(meta_model)
    for name, holders in by_name.items():
        value = initial_value(meta_model, name, seed, model_init, names)
        package.load_stage_state(holders, {name: value}, manifest)
        del value


def init_pipeline(held: Iterable[tuple[package.Held, torch.Tensor]], manifest: Manifest, directory: Any,
                  seed: int) -> None:
    """`pipe.init_weights(seed)`: the model file's model built on the meta device (nothing
    allocated), then `init_held`."""
    mf = package.load_model_file(manifest, directory)
    build = getattr(mf, manifest.source.entry, None)
    if not callable(build):
        raise InitError(f"model file {manifest.source.path} defines no {manifest.source.entry}(): init_weights builds "
                        f"the model on the meta device with it; compile the model again.")
    with torch.device("meta"):
        model = build()
    model_init = getattr(mf, "init_weights", None)
    init_held(held, manifest, model, seed, model_init if callable(model_init) else None)
