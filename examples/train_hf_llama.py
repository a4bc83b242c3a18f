"""Train a Hugging Face Llama with pipeline, tensor and data parallelism from your own script.

    torchrun --nproc-per-node 2 examples/train_hf_llama.py --steps 20
    torchrun --nproc-per-node 2 examples/train_hf_llama.py --steps 40   # resumes at step 20, trains to 40
    torchrun --nproc-per-node 4 examples/train_hf_llama.py --stages 2 --dp 2 --precision bf16-mixed \
        --checkpoints checkpoints-dp2 --export llama-dp2                # another run: folders of its own
    torchrun --nproc-per-node 2 examples/train_hf_llama.py --pretrained ./my-llama \
        --checkpoints checkpoints-mine --export my-llama-trained        # from a from_pretrained folder

A complete loop to start from (docs/from-your-script.md): a LlamaForCausalLM from a small
config (or a local folder), `partitioner.parallelize`, a DataLoader whose DistributedSampler
gives each data-parallel replica only its own rows (`local=True`), AdamW with weight-decay
groups, a cosine schedule with warm-up, gradient clipping, periodic evaluation, a checkpoint
every K steps and resume from the newest complete one, and a `from_pretrained` folder at the
end.  The text is made up on the fly (no downloads) and read as bytes: token id = byte value.
Run it again with the same --checkpoints folder and it resumes where it stopped: --steps is
the total to train to, so a run whose newest checkpoint is already there (or past it) trains
nothing, leaves the export as it is and exits with status 2, saying so.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

import partitioner
import runtime

VOCAB = 256  # one token per byte


def loss_fn(output, target):
    """Next-token cross-entropy over every position (a top-level function: the package imports it)."""
    logits = output.logits  # (B, T, vocab)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def make_text(chars: int, seed: int = 0) -> bytes:
    """Sentences from a small grammar: enough structure for the loss to fall in a few steps."""
    rng = random.Random(seed)
    who = ["the cat", "a dog", "my friend", "the pipeline", "every rank", "the optimizer"]
    does = ["sends", "receives", "computes", "waits for", "sums", "checks"]
    what = ["the gradient", "a message", "the next batch", "its stage", "the loss", "a checkpoint"]
    text = ""
    while len(text) < chars:
        text += f"{rng.choice(who)} {rng.choice(does)} {rng.choice(what)}. "
    return text[:chars].encode()


def token_dataset(text: bytes, seq: int) -> TensorDataset:
    """(inputs, targets) rows of `seq` tokens: targets are the inputs shifted by one."""
    ids = torch.tensor(list(text), dtype=torch.long)
    rows = (len(ids) - 1) // seq
    x = ids[: rows * seq].view(rows, seq)
    y = ids[1: rows * seq + 1].view(rows, seq)
    return TensorDataset(x, y)


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    if args.pretrained:
        return LlamaForCausalLM.from_pretrained(args.pretrained, torch_dtype=torch.float32)
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.seq, tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM(config)


def no_decay(name: str) -> dict[str, float]:
    """AdamW's groups: no weight decay for norms and biases (options per original name)."""
    return {"weight_decay": 0.0} if name.endswith("norm.weight") or name.endswith(".bias") else {}


def cosine_with_warmup(opt: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def evaluate(pipe, loader: DataLoader) -> float:
    pipe.eval()
    with torch.no_grad():
        losses = [pipe.evaluate({"input_ids": x}, y, local=True).item() for x, y in loader]
    pipe.train()
    return sum(losses) / len(losses)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pretrained", help="a local from_pretrained folder (default: a small config)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=16, help="global batch: rows per step over all replicas")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--precision", default="fp32", help="fp32 | bf16-mixed")
    p.add_argument("--analytic", action="store_true", help="plan from FLOPs and bytes instead of measuring")
    p.add_argument("--package", help="the package folder (default: parallelize's cache)")
    p.add_argument("--eval-every", type=int, default=6)
    p.add_argument("--checkpoints", default="checkpoints", help="checkpoint folder; resumed from when it has one")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--export", default="llama-trained", help="the from_pretrained folder written at the end")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    model = build_model(args)
    data = token_dataset(make_text(args.batch * args.seq * 40, args.seed), args.seq)
    train, held_out = torch.utils.data.random_split(data, [0.9, 0.1], torch.Generator().manual_seed(args.seed))
    example = {"input_ids": data.tensors[0][: args.batch]}  # one whole global batch: its shapes plan the pipeline

    # 1. the pipeline: rank 0 compiles (or reuses the cached package), every rank gets its stages
    pipe = partitioner.parallelize(model, example, loss_fn, out=args.package, stages=args.stages, tp=args.tp,
                                   dp=args.dp, precision=args.precision, analytic=args.analytic, quiet=True,
                                   optimizer="adamw")
    rank0 = getattr(pipe, "rank", 0) == 0

    # 2. each replica loads only its own rows
    rows = args.batch // pipe.replicas
    sampler = DistributedSampler(train, num_replicas=pipe.replicas, rank=pipe.replica, seed=args.seed, drop_last=True)
    loader = DataLoader(train, batch_size=rows, sampler=sampler, drop_last=True)
    eval_loader = DataLoader(held_out, batch_size=rows, drop_last=True,
                             sampler=DistributedSampler(held_out, num_replicas=pipe.replicas, rank=pipe.replica,
                                                        shuffle=False, drop_last=True))

    # 3. optimizer, schedule, and resume from the newest complete checkpoint
    opt = pipe.make_optimizer(torch.optim.AdamW, no_decay, lr=args.lr, weight_decay=0.1)
    sched = cosine_with_warmup(opt, args.warmup, args.steps)
    step, loss = 0, None
    found = runtime.load_latest(pipe, args.checkpoints, optimizer=opt)  # None on the first start
    if found is not None:
        step = found[1]["step"]
        sched.load_state_dict(found[1]["scheduler"])
        if rank0:
            print(f"resumed from {found[0]} at step {step}", flush=True)
    if step >= args.steps:  # nothing left to train: the export is left as it is
        if rank0:
            print(f"error: {found[0] if found else args.checkpoints} is at step {step} and --steps {args.steps} is the "
                  f"total to train to, so there is nothing left to train and {args.export} is left as it is: pass "
                  f"--steps above {step} to train on from it, or another --checkpoints folder to start afresh.",
                  file=sys.stderr, flush=True)
        sys.exit(2)

    # 4. the loop
    predicted = pipe.manifest.predicted.step_time_s if pipe.manifest.predicted else float("nan")
    bar = tqdm(total=args.steps, initial=step, disable=not rank0, dynamic_ncols=True)
    while step < args.steps:
        epoch, skip = divmod(step, len(loader))
        sampler.set_epoch(epoch)
        for x, y in itertools.islice(loader, skip, None):
            start = time.perf_counter()
            opt.zero_grad()
            loss = pipe.train_step({"input_ids": x}, y, local=True)
            norm = pipe.clip_grad_norm_(args.clip)
            opt.step()
            sched.step()
            step += 1
            took = time.perf_counter() - start
            bar.set_postfix(loss=f"{loss.item():.3f}", norm=f"{norm.item():.2f}",
                            tok_s=f"{args.batch * args.seq / took:.0f}",
                            step_ms=f"{took * 1e3:.1f} (predicted {predicted * 1e3:.1f})")
            bar.update(1)
            if step % args.eval_every == 0:
                held = evaluate(pipe, eval_loader)  # every rank takes part
                if rank0:
                    bar.write(f"step {step}: held-out loss {held:.3f}")
            if step % args.save_every == 0 or step == args.steps:
                pipe.save_checkpoint(Path(args.checkpoints) / f"step-{step:06d}", optimizer=opt,
                                     extra={"step": step, "scheduler": sched.state_dict()}, keep=2)
            if step == args.steps:
                break
    bar.close()

    # 5. a from_pretrained folder: the whole state_dict under the original names
    state = pipe.state_dict()  # collective: every rank takes part
    if rank0:
        model.load_state_dict(state)
        model.save_pretrained(args.export)
        last = "" if loss is None else f", last loss {loss.item():.4f}"
        print(f"trained {step} steps{last}; wrote {args.export}", flush=True)


if __name__ == "__main__":
    main()
