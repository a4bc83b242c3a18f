"""A hand-written tensor-parallel package, written as the code generator writes them
(runtime/manifest.py, [Note: shards] in runtime/package.py), so the runtime's tp path is
tested on its own.

The model (`tp_net.py`, written beside the package), Megatron-style under tp = T:

    emb = wte(ids)                      vocabulary-parallel embedding: wte rows split,
                                        tp.vocab_shard, masked, tp.all_reduce
    y = fc2(gelu(fc1(emb))) + emb       MLP: fc1 column-parallel (rows), fc2 row-parallel
                                        (columns) + tp.all_reduce; fc2.bias replicated
    q, k, v = qkv(y).chunk(3, -1)       fused qkv column-parallel with blocks=3
    z = tanh(q) * k + v + y             local on each rank's columns, then tp.all_gather
    logits = head(z)                    head.weight IS wte.weight (tied, split on rows),
                                        then tp.all_gather of the vocabulary

Stages: 1 = E+Q in one stage; 2 = E | Q, with wte tied across the two positions.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from runtime.manifest import (Manifest, Mesh, ModelInput, ParamSpec, Shard, Source, StageInput, StageOutput, StageSpec,
                              TiedParameter)

from .conftest import placeholder_prediction, write_manifest

V, D, H, BATCH = 32, 16, 32, 16

MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn

V, D, H, BATCH = 32, 16, 32, 16


class TpNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        emb = self.wte(ids)
        y = self.fc2(F.gelu(self.fc1(emb))) + emb
        q, k, v = self.qkv(y).chunk(3, -1)
        z = torch.tanh(q) * k + v + y
        return self.head(z)


def build_model():
    return TpNet()


def example_inputs():
    return (torch.randint(0, V, (BATCH,), generator=torch.Generator().manual_seed(1)),)


def example_target():
    return torch.randint(0, V, (BATCH,), generator=torch.Generator().manual_seed(2))


def loss_fn(output, target):
    return F.cross_entropy(output, target)
'''

# the two segments: (reads, makes, parameters (attr, source, local shape, shard dim, blocks), body)
Param = tuple[str, str, list[int], "int | None", int]


def _segments(t: int) -> dict[str, tuple[list[str], list[str], list[Param], list[str]]]:
    return {
        "E": (["ids"], ["y"], [
            ("wte_weight", "wte.weight", [V // t, D], 0, 1),
            ("fc1_weight", "fc1.weight", [H // t, D], 0, 1),
            ("fc1_bias", "fc1.bias", [H // t], 0, 1),
            ("fc2_weight", "fc2.weight", [D, H // t], 1, 1),
            ("fc2_bias", "fc2.bias", [D], None, 1),
        ], [
            f"local_ids, outside = tp.vocab_shard(ids, {V // t})  # (R,)",
            "embedding = F.embedding(local_ids, self.wte_weight)  # (R, 16)",
            "emb = tp.all_reduce(embedding.masked_fill(outside.unsqueeze(-1), 0.0))  # (R, 16)",
            f"gelu = F.gelu(F.linear(tp.copy(emb), self.fc1_weight, self.fc1_bias))  # (R, {H // t})",
            "y = tp.all_reduce(F.linear(gelu, self.fc2_weight)) + self.fc2_bias + emb  # (R, 16)",
        ]),
        "Q": (["y"], ["output"], [
            ("qkv_weight", "qkv.weight", [3 * D // t, D], 0, 3),
            ("qkv_bias", "qkv.bias", [3 * D // t], 0, 3),
            ("wte_weight", "wte.weight", [V // t, D], 0, 1),
        ], [
            f"qkv = F.linear(tp.copy(y), self.qkv_weight, self.qkv_bias)  # (R, {3 * D // t})",
            "q, k, v = qkv.chunk(3, -1)",
            "z = tp.all_gather(torch.tanh(q) * k + v, -1) + y  # (R, 16)",
            f"output = tp.all_gather(F.linear(tp.copy(z), self.wte_weight), -1)  # (R, {V})",
        ]),
    }


SPLITS = {1: ["EQ"], 2: ["E", "Q"]}


def _source(k: int, count: int, reads: list[str], params: list[Param], body: list[str], rows: int, out: str) -> str:
    lines = [f"# stage_{k}.py -- hand-written tensor-parallel test package for tp_net.py, stage {k} of {count}",
             "import torch", "import torch.nn.functional as F", "", "from runtime import tp", "", "",
             f"class Stage{k}(torch.nn.Module):", "    def __init__(self) -> None:", "        super().__init__()"]
    for attr, source, shape, _, _ in params:
        lines.append(f"        self.{attr} = torch.nn.Parameter(torch.zeros({', '.join(map(str, shape))}))  # {source}")
    lines += ["", f"    def forward(self, {', '.join(reads)}):"]
    lines += [f"        {line.replace('(R', f'({rows}')}" for line in body]
    lines.append(f"        return {out}")
    return "\n".join(lines) + "\n"


def _shard(dim: int | None, t: int, blocks: int) -> Shard:
    if dim is None or t == 1:
        return Shard()
    return Shard(dim, "tp", t, blocks if blocks > 1 else None)


def write_tp_package(root: Path, stages: int = 2, tp: int = 2, dp: int = 1, microbatches: int = 2,
                     schedule: str = "1f1b", name: str = "pkg", zero: int = 0) -> Path:
    """Write tp_net.py into `root` and a package for it into root/name; return the package dir."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "tp_net.py").write_text(MODEL)
    out = root / name
    out.mkdir()
    segments, rows = _segments(tp), BATCH // (microbatches * dp)
    entries = []
    for k, segs in enumerate(SPLITS[stages]):
        reads = segments[segs[0]][0]
        params = [p for s in segs for p in segments[s][2]]
        params = [p for i, p in enumerate(params) if p[0] not in [q[0] for q in params[:i]]]
        body = [line for s in segs for line in segments[s][3]]
        last = k == stages - 1
        entries.append(StageSpec(
            index=k, module=f"stage_{k}", class_name=f"Stage{k}",
            ranks=tuple((r * stages + k) * tp + t for r in range(dp) for t in range(tp)),
            inputs=(StageInput("ids", (rows,), "int64", "input", False),)
            if k == 0 else (StageInput("y", (rows, D), "float32", 0, True),),
            outputs=(StageOutput("output", None, None, "output", True),)
            if last else (StageOutput("y", (rows, D), "float32", (1,), True),),
            parameters=tuple(ParamSpec(a, s, tuple(shape), "float32", True, _shard(dim, tp, blocks))
                             for a, s, shape, dim, blocks in params),
            nodes=len(body),
        ))
        (out / f"stage_{k}.py").write_text(_source(k, stages, reads, params, body, rows, "output" if last else "(y,)"))
    manifest = Manifest(
        options={"zero": zero} if zero else {},
        source=Source("tp_net.py", hashlib.sha256(MODEL.encode()).hexdigest(), "build_model", 0),
        tracer="fx",
        mesh=Mesh(stages, tp, dp),
        schedule=schedule,
        microbatches=microbatches,
        virtual_stages=1,
        batch_size=BATCH,
        inputs=(ModelInput("ids", 0, 0, (rows,), "int64"),),
        stages=tuple(entries),
        tied_parameters=(TiedParameter("wte.weight", (0, 1)),) if stages == 2 else (),
        state_dict_aliases={"head.weight": "wte.weight"},
        predicted=placeholder_prediction(stages),
    )
    write_manifest(out, manifest)
    return out
