"""The local=True modes of dist_worker.py (each replica given only its own rows).

MODE local: every replica trains on the rows a DistributedSampler(num_replicas=pipe.replicas,
rank=pipe.replica, shuffle=False) gives it (None where a rank's stages do not read them),
3 SGD steps; a second pipeline trains on the global batches (each replica's rows in turn):
the losses and weights agree (rtol 1e-6), and both equal the original model on the global
batches.  Then, with dp = 2 and a package whose batch is free, a short last batch of 5 rows
on replica 0 and 4 on replica 1, against the original on those 9 rows; and pipe(x, local=True)
gives this replica's rows of the output.
MODE localnone: every rank but the first stage's passes None for its inputs, but the later
stage reads a model input: every rank raises the same BatchError, naming that rank.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import runtime

RTOL, ATOL = 1e-5, 1e-6
SAME_RTOL, SAME_ATOL = 1e-6, 1e-7  # the local and the global form: the same arithmetic
PER_REPLICA = 3  # rows a replica is given per step (8 rows a replica: 3, 3, then a short 2)


def _model_file(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("_local_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _needs(pipe: runtime.DistributedPipeline) -> tuple[bool, bool]:
    """(this rank's stages read a model input, this rank runs the last stage)."""
    runners = list(pipe.runners.values())
    return (any(spec.source == "input" for r in runners for spec in r.entry.inputs),
            any(r.is_last for r in runners))


def _replica_batches(dataset: TensorDataset, replicas: int, replica: int) -> list[list[int]]:
    """The indices of each step's batch that the sampler gives `replica`."""
    indices: list[int] = list(DistributedSampler(dataset, num_replicas=replicas, rank=replica, shuffle=False))
    return [indices[i:i + PER_REPLICA] for i in range(0, len(indices), PER_REPLICA)]


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float, atol: float, what: str) -> None:
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=lambda m: f"{what} {name}: {m}")


def local(pkg: str, model_path: str) -> None:
    mf = _model_file(model_path)
    torch.manual_seed(0)
    model = mf.build_model()
    x, y = mf.example_inputs()[0], mf.example_target()
    dataset = TensorDataset(x, y)
    pipe, whole = runtime.DistributedPipeline(pkg), runtime.DistributedPipeline(pkg)
    for p in (pipe, whole):
        p.load_state_dict(model.state_dict())
    reads, last = _needs(pipe)
    loader = DataLoader(dataset, batch_size=PER_REPLICA,
                        sampler=DistributedSampler(dataset, num_replicas=pipe.replicas, rank=pipe.replica,
                                                   shuffle=False))
    steps = list(zip(*[_replica_batches(dataset, pipe.replicas, r) for r in range(pipe.replicas)]))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (pipe, whole, model)]
    for (xl, yl), rows in zip(loader, steps):
        glob = torch.cat([torch.tensor(r) for r in rows])
        for opt in opts:
            opt.zero_grad()
        got = pipe.train_step(xl if reads else None, yl if last else None, local=True)
        same = whole.train_step(x[glob], y[glob])
        ref = mf.loss_fn(model(x[glob]), y[glob])
        ref.backward()
        torch.testing.assert_close(got, same, rtol=SAME_RTOL, atol=SAME_ATOL)
        torch.testing.assert_close(got, ref.detach(), rtol=RTOL, atol=ATOL)
        for opt in opts:
            opt.step()
    _close(pipe.state_dict(), whole.state_dict(), SAME_RTOL, SAME_ATOL, "local against global")
    _close(pipe.state_dict(), model.state_dict(), RTOL, ATOL, "local against the model")
    if pipe.manifest.free_dims:
        _short(pipe, model, mf, x, y, reads, last)
    print(f"{pipe.rank} ok", flush=True)


def _short(pipe: runtime.DistributedPipeline, model: torch.nn.Module, mf: Any, x: torch.Tensor, y: torch.Tensor,
           reads: bool, last: bool) -> None:
    """A short last batch of 9 rows: 5 on replica 0, 4 on replica 1 (dp = 2)."""
    assert pipe.replicas == 2, pipe.replicas
    mine = slice(0, 5) if pipe.replica == 0 else slice(5, 9)
    opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    ref_opt.zero_grad()
    got = pipe.train_step(x[mine] if reads else None, y[mine] if last else None, local=True)
    ref = mf.loss_fn(model(x[:9]), y[:9])
    ref.backward()
    torch.testing.assert_close(got, ref.detach(), rtol=RTOL, atol=ATOL)
    opt.step()
    ref_opt.step()
    _close(pipe.state_dict(), model.state_dict(), RTOL, ATOL, "after the short batch:")
    with torch.no_grad():
        torch.testing.assert_close(pipe.evaluate(x[mine] if reads else None, y[mine] if last else None, local=True),
                                   mf.loss_fn(model(x[:9]), y[:9]), rtol=RTOL, atol=ATOL)
        want = model(x[mine])  # after 4 steps the weights differ by float32 rounding: atol scaled to the output
        torch.testing.assert_close(pipe(x[mine] if reads else None, local=True), want, rtol=RTOL,
                                   atol=RTOL * float(want.abs().max()))


def local_none(pkg: str, model_path: str) -> None:
    mf = _model_file(model_path)
    pipe = runtime.DistributedPipeline(pkg)
    x, y = mf.example_inputs()[0], mf.example_target()
    mine = slice(pipe.replica * 8, pipe.replica * 8 + 8)
    pipe.train_step(x[mine] if pipe.position == 0 else None, y[mine], local=True)


MODES = {"local": local, "localnone": local_none}
