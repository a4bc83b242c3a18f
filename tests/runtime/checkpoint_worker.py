"""Ranks of a multi-process checkpoint test, forked from one process that imported torch once:
`python checkpoint_worker.py N PHASE OUTDIR PKG ROOT` (every rank on PKG; checkpoints under ROOT).

PHASE save:   the model's seed-0 weights, 3 AdamW steps, save ROOT/step-3, 3 more steps.
PHASE crash:  load ROOT/step-3, 1 step, save ROOT/step-4 (the test sets PIPELINE_CHECKPOINT_FAULT
              so that one rank kills itself in the middle of it).
PHASE resume: load runtime.latest_checkpoint(ROOT), 3 steps, save ROOT/resumed.
PHASE init:   pipe.init_weights(seed=5) only (and state_dict(rank=0) checked against state_dict()).
Rank 0 writes OUTDIR/result.pt: the losses after the checkpoint and the final state_dict.
Rank r writes OUTDIR/rank<r>.out / .err; a PipelineError exits 3 with its message; the
parent prints `rank r: exit code` per rank.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.fx.experimental.symbolic_shapes  # noqa: F401  (autograd imports it lazily: ~1 s per rank)
import torch._dynamo  # noqa: F401  (the optimizer's first step imports it: ~2 s per rank)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import runtime  # noqa: E402
from runtime import package  # noqa: E402
from runtime.errors import PipelineError  # noqa: E402


def _phase(phase: str, pkg: str, root: Path, outdir: Path) -> None:
    pipe = runtime.DistributedPipeline(pkg)
    mf = package.load_model_file(pipe.manifest, pkg)
    opt = pipe.make_optimizer(torch.optim.AdamW, lr=0.01, weight_decay=0.1)  # ZeRO-1 where compiled so
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    step = 0

    def train(steps: int) -> list[torch.Tensor]:
        nonlocal step
        out = []
        for _ in range(steps):
            opt.zero_grad()
            out.append(pipe.train_step(mf.example_inputs(), mf.example_target()))
            opt.step()
            sched.step()
            step += 1
        return out

    def save(name: str) -> None:
        pipe.save_checkpoint(root / name, opt, extra={"scheduler": sched.state_dict(), "step": step})

    def load(path: Path) -> None:
        nonlocal step
        extra = pipe.load_checkpoint(path, optimizer=opt)
        sched.load_state_dict(extra["scheduler"])
        step = extra["step"]

    if phase == "init":
        pipe.init_weights(seed=5)
        losses = []
        on_one = pipe.state_dict(rank=0)  # gathered on rank 0 only
        if pipe.rank == 0:
            whole = pipe.state_dict()
            assert set(on_one) == set(whole) and all(torch.equal(on_one[k], whole[k]) for k in whole)
        else:
            assert on_one == {}
            pipe.state_dict()
    elif phase == "save":
        torch.manual_seed(0)
        pipe.load_state_dict(mf.build_model().state_dict())
        train(3)
        save("step-3")
        losses = train(3)
    elif phase == "crash":
        load(root / "step-3")
        train(1)
        save("step-4")
        losses = []
    else:
        latest = runtime.latest_checkpoint(root)
        assert latest == root / "step-3", latest
        load(latest)
        losses = train(3)
        save("resumed")
    state = pipe.state_dict()
    if pipe.rank == 0:
        torch.save({"losses": losses, "state_dict": state}, outdir / "result.pt")
    print(f"{pipe.rank} ok", flush=True)


def _rank(r: int, phase: str, pkg: str, root: Path, outdir: Path) -> int:
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(r)
    os.dup2(os.open(outdir / f"rank{r}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
    os.dup2(os.open(outdir / f"rank{r}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    try:
        _phase(phase, pkg, root, outdir)
    except PipelineError as exc:
        print(f"PipelineError: {exc}", file=sys.stderr, flush=True)
        return 3
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    return 0


def main() -> int:
    n, phase, outdir, pkg, root = sys.argv[1:]
    children = {}
    for r in range(int(n)):
        pid = os.fork()
        if pid == 0:
            os._exit(_rank(r, phase, pkg, Path(root), Path(outdir)))  # skip teardown
        children[pid] = r
    while children:
        pid, status = os.waitpid(-1, 0)
        print(f"rank {children.pop(pid)}: {os.waitstatus_to_exitcode(status)}", flush=True)
        time.sleep(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
