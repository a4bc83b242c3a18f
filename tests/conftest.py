"""Shared fixtures: a private profile cache, the repo root as cwd, golden-file switch."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
#: a hardware profile whose links cost nothing: the tensor-parallel solver splits all it can
#: (on a real profile the tiny examples stay whole), so the tests exercise every split
FREE_LINKS = str(ROOT / "tests" / "profiles" / "free_links.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/golden/ from the current code")


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    old = os.environ.get("PARTITIONER_CACHE")
    os.environ["PARTITIONER_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if old is None:
        os.environ.pop("PARTITIONER_CACHE", None)
    else:
        os.environ["PARTITIONER_CACHE"] = old


@pytest.fixture(autouse=True)
def _seed_and_cwd(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    monkeypatch.chdir(ROOT)


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))


#: CP-SAT's deterministic seconds for tests that check how any plan trains (the solver's own
#: tests check how good a plan is); the 5 s default keeps the plans other tests were written for
ANY_PLAN_S = 1.0


def compile_example(path: str, out: Path, **options: Any) -> Any:
    """Compile a model file quietly with deterministic (analytic) costs unless told."""
    from driver.compile import compile_model
    from driver.options import CompileOptions

    options.setdefault("analytic", True)
    options.setdefault("hardware", "a100")
    options.setdefault("quiet", True)
    options.setdefault("time_limit", 5.0)
    return compile_model(CompileOptions(model=path, out=str(out), **options))


def train_pipeline(pipe: Any, path: str, steps: int, lr: float) -> list[float]:
    """`pipe` (weights loaded) trained `steps` SGD steps on the model file's example batch:
    the losses."""
    from partitioner.trace import model_file

    mf = model_file.load(path)
    args, kwargs = mf.example_inputs()
    inputs, target = (kwargs if kwargs else args), mf.example_target()
    opt = torch.optim.SGD(pipe.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(float(pipe.train_step(inputs, target)))
        opt.step()
    return losses


def train_original(path: str, steps: int, lr: float) -> tuple[list[float], dict[str, Any]]:
    """The original model of a model file trained `steps` SGD steps on its whole example
    batch: the losses, and the state_dict after.  It trains once per (path, steps, lr) in a
    session (every case of an example compares with the same reference); each caller gets
    its own copies."""
    losses, state = _trained_original(path, steps, lr)
    return list(losses), {k: v.clone() for k, v in state.items()}


@functools.cache
def _trained_original(path: str, steps: int, lr: float) -> tuple[tuple[float, ...], dict[str, Any]]:
    """`train_original`, computed once; never hand these tensors out (see above).  The model
    is built from its seed (`build(0)`), so the result does not depend on the caller's RNG;
    the caller's RNG state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        losses, state = _train_original(path, steps, lr)
    return tuple(losses), state


def _train_original(path: str, steps: int, lr: float) -> tuple[list[float], dict[str, Any]]:
    from partitioner.trace import model_file

    mf = model_file.load(path)
    model = mf.build(0)
    args, kwargs = mf.example_inputs()
    target, loss_fn = mf.example_target(), mf.loss_fn()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(*args, **kwargs), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
