"""The parallelize mode of dist_worker.py: every rank builds the same model (seed 0), calls
`partitioner.parallelize(model, example, loss_fn, out=PKG, **options)` (rank 0 compiles, the
others wait) and trains 2 SGD steps, against the original model trained alike in this process.

The case comes from env PARALLELIZE_CASE, JSON: {"model": "gpt" | "llama", "options": {...},
"local": bool, "error": optional}.  error: rank 0's compile fails; every rank must raise an error
holding each of the strings in case["error"][rank] (rank 0 its own, the others rank 0's word).  local: each replica is given only the rows a DistributedSampler(num_replicas=
pipe.replicas, rank=pipe.replica) gives it (`train_step(..., local=True)`); the loss is still
the global batch's, as the original's on the whole batch.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

import partitioner  # noqa: E402
from tests import parallelize_models  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6


def _parallelize(pkg: str, _model_path: str) -> None:
    case = json.loads(os.environ["PARALLELIZE_CASE"])
    model, (args, kwargs), target, loss_fn = parallelize_models.build(case["model"])
    reference = copy.deepcopy(model)
    if case.get("error"):
        return _fails(model, kwargs or args, loss_fn, pkg, case)
    pipe = partitioner.parallelize(model, kwargs or args, loss_fn, out=pkg, **case["options"])
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    rows = list(DistributedSampler(range(target.shape[0]), num_replicas=pipe.replicas, rank=pipe.replica,
                                   shuffle=False))
    for _ in range(2):
        opt.zero_grad()
        ref.zero_grad()
        if case["local"]:
            mine = [a[rows] for a in args], {k: v[rows] for k, v in kwargs.items()}
            got = pipe.train_step(mine[1] or tuple(mine[0]), target[rows], local=True)
        else:
            got = pipe.train_step(kwargs or args, target)
        want = loss_fn(reference(*args, **kwargs), target)
        want.backward()
        opt.step()
        ref.step()
        torch.testing.assert_close(got.detach(), want.detach(), rtol=RTOL, atol=ATOL)
    state = pipe.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{key}: {m}")
    print(f"{pipe.rank} ok", flush=True)


def _fails(model: torch.nn.Module, example: object, loss_fn: object, pkg: str, case: dict[str, object]) -> None:
    rank = int(os.environ["RANK"])
    try:
        partitioner.parallelize(model, example, loss_fn, out=pkg, **case["options"])  # type: ignore[arg-type]
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
        missing = [s for s in case["error"][rank] if s not in text]  # type: ignore[index]
        assert not missing, f"rank {rank} raised {text!r}, without {missing}"
        print(f"{rank} ok", flush=True)
        return
    raise AssertionError(f"rank {rank}: parallelize did not fail")


MODES = {"parallelize": _parallelize}
