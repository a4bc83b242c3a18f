"""A hand-written package, built through runtime/manifest.py as codegen builds one, so the runtime is tested on its own.

The model (`tiny.py`, written beside the package): an MLP whose first weight is tied to
its head (`head.weight = embed.weight`, so the state_dict has an alias), with a skip value
`tanh` made by stage 0 and read by every later stage, a model input read again by stage 1,
a persistent buffer and a non-persistent one (from constants.pt):

    x -> tanh = tanh(embed x) -> relu = relu(fc1 tanh)                      segment A
      -> add_2 = tanh(fc2 relu + tanh) * scale + 0.5 x + offset              segment B
      -> tanh_2 = tanh(fc3 add_2 + tanh)                                     segment C
      -> output = head(tanh_2 + tanh)       (head.weight is embed.weight)    segment D

Stages by count: 2 = A | BCD, 3 = A | B | CD, 4 = A | B | C | D.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from runtime.manifest import (BufferSpec, Manifest, Mesh, ModelInput, ParamSpec, Predicted, Source, StageInput,
                              StageOutput, StagePrediction, StageSpec, TiedParameter)
from runtime.schedule import placement

D, BATCH = 16, 16

MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn

D, BATCH = 16, 16


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D, D, bias=False)
        self.fc1 = nn.Linear(D, D)
        self.fc2 = nn.Linear(D, D)
        self.fc3 = nn.Linear(D, D)
        self.head = nn.Linear(D, D)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((D,), 0.5))
        self.register_buffer("offset", torch.linspace(-0.1, 0.1, D), persistent=False)

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        a = torch.relu(self.fc1(h))
        b = torch.tanh(self.fc2(a) + h) * self.scale + 0.5 * x + self.offset
        c = torch.tanh(self.fc3(b) + h)
        return self.head(c + h)


def build_model():
    return TinyNet()


def example_inputs():
    return (torch.randn(BATCH, D, generator=torch.Generator().manual_seed(1)),)


def example_target():
    return torch.randn(BATCH, D, generator=torch.Generator().manual_seed(2))


def loss_fn(output, target):
    return F.mse_loss(output, target)
'''

# segment: (values read, values made, parameters (attr, source name), buffers (attr, source, persistent), body)
SEGMENTS: dict[str, tuple[list[str], list[str], list[tuple[str, str]], list[tuple[str, str, bool]], list[str]]] = {
    "A": (["x"], ["tanh", "relu"], [("embed_weight", "embed.weight"), ("fc1_weight", "fc1.weight"), ("fc1_bias", "fc1.bias")], [], [
        "linear = F.linear(x, self.embed_weight)  # (R, 16)",
        "tanh = torch.tanh(linear)  # (R, 16)",
        "linear_1 = F.linear(tanh, self.fc1_weight, self.fc1_bias)  # (R, 16)",
        "relu = torch.relu(linear_1)  # (R, 16)",
    ]),
    "B": (["relu", "tanh", "x"], ["add_2"], [("fc2_weight", "fc2.weight"), ("fc2_bias", "fc2.bias")],
          [("scale", "scale", True), ("offset", "offset", False)], [
        "linear_2 = F.linear(relu, self.fc2_weight, self.fc2_bias)  # (R, 16)",
        "tanh_1 = torch.tanh(linear_2 + tanh)  # (R, 16)",
        "add_2 = tanh_1 * self.scale + 0.5 * x + self.offset  # (R, 16)",
    ]),
    "C": (["add_2", "tanh"], ["tanh_2"], [("fc3_weight", "fc3.weight"), ("fc3_bias", "fc3.bias")], [], [
        "linear_3 = F.linear(add_2, self.fc3_weight, self.fc3_bias)  # (R, 16)",
        "tanh_2 = torch.tanh(linear_3 + tanh)  # (R, 16)",
    ]),
    "D": (["tanh_2", "tanh"], ["output"], [("embed_weight", "embed.weight"), ("head_bias", "head.bias")], [], [
        "output = F.linear(tanh_2 + tanh, self.embed_weight, self.head_bias)  # (R, 16)",
    ]),
}
SPLITS = {2: ["A", "BCD"], 3: ["A", "B", "CD"], 4: ["A", "B", "C", "D"]}

INIT = '''"""A hand-written test package."""
import importlib.util
import json
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(_HERE, "manifest.json")) as _f:
    MANIFEST = json.load(_f)


def load_stage(index):
    stage = MANIFEST["stages"][index]
    spec = importlib.util.spec_from_file_location(__name__ + "." + stage["module"], os.path.join(_HERE, stage["module"] + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, stage["class"])()
'''


def _stages(count: int) -> list[dict[str, Any]]:
    """Each stage's reads, outputs, parameters, buffers and body, from the segment table."""
    stages: list[dict[str, Any]] = []
    maker: dict[str, int] = {"x": -1}
    for k, segs in enumerate(SPLITS[count]):
        made: list[str] = []
        reads: list[str] = []
        params: list[tuple[str, str]] = []
        buffers: list[tuple[str, str, bool]] = []
        body: list[str] = []
        for seg in segs:
            r, m, p, b, lines = SEGMENTS[seg]
            reads += [v for v in r if v not in made and v not in reads]
            made += m
            params += [x for x in p if x not in params]
            buffers += b
            body += lines
        for v in made:
            maker[v] = k
        stages.append({"reads": reads, "made": made, "params": params, "buffers": buffers, "body": body})
    for k, st in enumerate(stages):
        st["from"] = {v: maker[v] for v in st["reads"]}
        later = [(j, s2) for j, s2 in enumerate(stages) if j > k]
        st["to"] = {v: [j for j, s2 in later if v in s2["reads"]] for v in st["made"]}
        st["outputs"] = [v for v in st["made"] if st["to"][v]] if k < count - 1 else ["output"]
    return stages


def _source(k: int, count: int, st: dict[str, Any], model: str, rows: int) -> str:
    lines = [f"# stage_{k}.py -- hand-written test package for {model}, stage {k} of {count}",
             "import os", "", "import torch", "import torch.nn.functional as F", "", "",
             f"class Stage{k}(torch.nn.Module):", "    def __init__(self) -> None:", "        super().__init__()"]
    for attr, source in st["params"]:
        dims = f"{D}, {D}" if source.endswith("weight") else f"{D}"
        lines.append(f"        self.{attr} = torch.nn.Parameter(torch.zeros({dims}))  # {source}")
    if st["buffers"]:
        lines.append("        constants = torch.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "
                     "'constants.pt'), weights_only=True)")
    for attr, source, persistent in st["buffers"]:
        lines.append(f"        self.register_buffer({attr!r}, constants[{source!r}], persistent={persistent})")
    lines += ["", f"    def forward(self, {', '.join(st['reads'])}):"]
    lines += [f"        {line.replace('(R,', f'({rows},')}" for line in st["body"]]
    out = st["outputs"]
    lines.append(f"        return {out[0]}" if out == ["output"] else f"        return ({', '.join(out)},)")
    return "\n".join(lines) + "\n"


def write_package(root: Path, stages: int = 3, schedule: str = "1f1b", microbatches: int = 4, dp: int = 1,
                  virtual_stages: int = 1, name: str = "pkg", model_path: str = "tiny.py") -> Path:
    """Write tiny.py into `root` and a package for it into root/name; return the package dir."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "tiny.py").write_text(MODEL)
    out = root / name
    out.mkdir()
    pp = stages // virtual_stages
    rows = BATCH // (microbatches * dp)
    table = _stages(stages)
    position = placement(schedule, stages, pp)  # s % pp, or zb-v's V
    entries = []
    for k, st in enumerate(table):
        shape = (rows, D)
        entries.append(StageSpec(
            index=k, module=f"stage_{k}", class_name=f"Stage{k}",
            ranks=tuple(r * pp + position[k] for r in range(dp)),
            inputs=tuple(StageInput(v, shape, "float32", "input" if st["from"][v] < 0 else st["from"][v],
                                    requires_grad=st["from"][v] >= 0) for v in st["reads"]),
            outputs=(StageOutput("output", None, None, "output", True),) if k == stages - 1 else
            tuple(StageOutput(v, shape, "float32", tuple(st["to"][v]), True) for v in st["outputs"]),
            parameters=tuple(ParamSpec(a, s, (D, D) if s.endswith("weight") else (D,)) for a, s in st["params"]),
            buffers=tuple(BufferSpec(a, s, (D,), "float32", p) for a, s, p in st["buffers"]),
            nodes=len(st["body"]),
        ))
        (out / f"stage_{k}.py").write_text(_source(k, stages, st, model_path, rows))
    model = _import(root / "tiny.py").build_model()
    torch.save({"scale": model.scale.clone(), "offset": model.offset.clone()}, out / "constants.pt")
    holders: dict[str, list[int]] = {}
    for e in entries:
        for p in e.parameters:
            holders.setdefault(p.source_name, []).append(e.index)
    manifest = Manifest(
        source=Source(model_path, hashlib.sha256(MODEL.encode()).hexdigest(), "build_model", 0),
        tracer="fx",
        mesh=Mesh(pp, 1, dp),
        schedule=schedule,
        microbatches=microbatches,
        virtual_stages=virtual_stages,
        batch_size=BATCH,
        inputs=(ModelInput("x", 0, 0, (rows, D), "float32"),),
        stages=tuple(entries),
        tied_parameters=tuple(TiedParameter(n, tuple(s)) for n, s in holders.items() if len(s) > 1),
        state_dict_aliases={"head.weight": "embed.weight"},
        predicted=placeholder_prediction(stages),
    )
    write_manifest(out, manifest)
    (out / "__init__.py").write_text(INIT)
    return out


def placeholder_prediction(stages: int) -> Predicted:
    """A placeholder prediction: the runtime never reads it."""
    return Predicted(0.001, 0.1, (StagePrediction(1e-4, 1000),) * stages)


def write_manifest(out: Path, manifest: Manifest) -> None:
    """manifest.json with its hash over itself and the stage files, as codegen writes it."""
    digest = hashlib.sha256(json.dumps(manifest.to_dict(), sort_keys=True).encode())
    for k in range(len(manifest.stages)):
        digest.update((out / f"stage_{k}.py").read_bytes())
    (out / "manifest.json").write_text(dataclasses.replace(manifest, hash=digest.hexdigest()).to_json())


_count = [0]


def _import(path: Path) -> types.ModuleType:
    _count[0] += 1
    name = f"_test_tiny_{_count[0]}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class Tiny:
    """A package and the reference model it was 'compiled' from."""

    dir: Path
    model_file: types.ModuleType

    def build(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return self.model_file.build_model()  # type: ignore[no-any-return]

    def batch(self) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        return self.model_file.example_inputs(), self.model_file.example_target()

    @property
    def loss_fn(self) -> Callable[[Any, Any], torch.Tensor]:
        return self.model_file.loss_fn  # type: ignore[no-any-return]


@pytest.fixture
def make_tiny(tmp_path: Path) -> Callable[..., Tiny]:
    """make_tiny(stages=3, schedule="1f1b", microbatches=4, dp=1, virtual_stages=1) -> Tiny."""
    made = [0]

    def make(**options: Any) -> Tiny:
        made[0] += 1
        root = tmp_path / f"case{made[0]}"
        pkg = write_package(root, **options)
        return Tiny(pkg, _import(root / "tiny.py"))

    return make


@pytest.fixture
def tiny(make_tiny: Callable[..., Tiny]) -> Tiny:
    """The 3-stage, 4-microbatch, 1F1B package."""
    return make_tiny()
