"""The user's own gradient checkpointing (torch.utils.checkpoint, reentrant or not, called
directly or through a Hugging Face model's `_gradient_checkpointing_func`) is traced as the
ops it runs, never as a cut gradient, and kept as the plan's recomputation
([Note: the user's checkpointing] in partitioner/trace/checkpointing.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from partitioner.errors import TraceError

from ..conftest import compile_example
from .harness import MODELS, trains_like_original

#: Hugging Face Llama's forward is not traceable by torch.fx here (with or without
#: checkpointing), so it is compiled by export and by auto (fx, then export)
CASES = [
    ("hf_llama_checkpointed", "export"),
    ("hf_llama_checkpointed", "auto"),
    ("hf_llama_checkpointed_nonreentrant", "export"),
    ("hf_llama_checkpointed_nonreentrant", "auto"),
    ("checkpointed_mlp", "fx"),
    ("checkpointed_mlp", "export"),
]


@pytest.mark.parametrize(("name", "tracer"), CASES)
def test_checkpointed_regions_train_like_the_original(name: str, tracer: str, tmp_path: Path) -> None:
    """Every gradient reaches the layers before (and inside) the checkpointed regions, and
    the package says the checkpointing is kept as recomputation."""
    pipe = trains_like_original(name, tmp_path / "pkg", stages=2, microbatches=2, tracer=tracer)
    assert all(stage.recompute for stage in pipe.manifest.stages)
    plan = (tmp_path / "pkg" / "plan.txt").read_text()
    assert "gradient checkpointing" in plan and "kept as the plan's recomputation" in plan
    source = "".join(p.read_text() for p in sorted((tmp_path / "pkg").glob("stage_*.py")))
    assert "Checkpoint" not in source and "checkpoint(" not in source


def test_the_regions_are_named(tmp_path: Path) -> None:
    compile_example(str(MODELS / "checkpointed_mlp.py"), tmp_path / "pkg", stages=2, tracer="fx")
    plan = (tmp_path / "pkg" / "plan.txt").read_text()
    assert "blocks.0, blocks.1, blocks.2" in plan


def test_under_a_mesh_search_the_planner_chooses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With --devices the search decides recomputation; the compile says one line that the
    user's checkpointing is replaced by that choice."""
    compile_example(str(MODELS / "checkpointed_mlp.py"), tmp_path / "pkg", devices=2, quiet=False)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "gradient checkpointing" in line]
    assert len(lines) == 1 and "replaced by the planner's recompute choice" in lines[0] and "--recompute" in lines[0]


def test_a_function_given_a_module_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "module_arg.py"
    model.write_text(
        "import torch\n"
        "class Call(torch.autograd.Function):\n"
        "    @staticmethod\n"
        "    def forward(ctx, module, x):\n"
        "        return module(x)\n"
        "    @staticmethod\n"
        "    def backward(ctx, grad):\n"
        "        return None, grad\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        return Call.apply(self.lin, x)\n"
        "def build_model():\n    return Net()\n"
        "def example_inputs():\n    return (torch.randn(4, 4),)\n"
    )
    with pytest.raises(TraceError, match=r"Call\.apply.*module.*Linear"):
        compile_example(str(model), tmp_path / "pkg", stages=2, tracer="fx")
