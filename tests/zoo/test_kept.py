"""A submodule neither tracer can trace (a data-dependent `if`) is kept
whole inside a larger model: placed on one stage, run as the user wrote it, trained like
the original; a top-level module with one is refused (exit 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import FREE_LINKS
from .harness import trains_like_original


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_submodule_with_data_dependent_control_flow_is_kept_whole(schedule: str, tmp_path: Path) -> None:
    trains_like_original("kept_whole", tmp_path / "pkg", stages=2, schedule=schedule)
    stages = [p.read_text() for p in sorted((tmp_path / "pkg").glob("stage_*.py"))]
    holding = [s for s in stages if "kept_module(__file__, 'gate')" in s]
    assert len(holding) == 1 and "kept_whole.py, line 17: `if torch.isfinite(h).all():`" in holding[0]
    assert "torch.func.functional_call(self.gate_module, {'fc.weight': self.gate_fc_weight" in holding[0]


def test_a_kept_module_is_never_tensor_split(tmp_path: Path) -> None:
    """With tp = 2 on free links (where the solver splits all it can) the kept module's
    weights stay whole on each rank and training still matches."""
    trains_like_original("kept_whole", tmp_path / "pkg", stages=2, tp=2, hardware=FREE_LINKS)
    held = next(s for s in (p.read_text() for p in sorted((tmp_path / "pkg").glob("stage_*.py"))) if "gate_module" in s)
    assert "self.gate_fc_weight = torch.nn.Parameter(torch.zeros(16, 16))" in held


def test_a_top_level_module_with_data_dependent_control_flow_is_refused(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "partitioner", "compile", "tests/model_files/data_dependent.py",
                           "--out", str(tmp_path / "pkg"), "--stages", "2", "--analytic"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    said = " ".join(done.stderr.split())
    assert "data_dependent.py, line 17: `if h.sum() > 0:`" in said and "Traceback" not in said


@pytest.mark.parametrize("name", ["rope_dynamic_ntk", "rope_dynamic_ntk_short"])
@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_kept_rotary_that_re_registers_its_buffer_trains_like_the_original(name: str, tracer: str,
                                                                             tmp_path: Path) -> None:
    """Dynamic NTK RoPE written by hand, kept whole: past its maximum length (rope_dynamic_ntk)
    its forward re-registers `inv_freq`, and every later call (the other microbatches, the
    next steps) must use the rebound buffer, as the original's module does; below it
    (rope_dynamic_ntk_short) the buffer stays."""
    trains_like_original(name, tmp_path / "pkg", steps=3, stages=2, microbatches=4, tracer=tracer)
    holding = next(s for s in (p.read_text() for p in sorted((tmp_path / "pkg").glob("stage_*.py"))) if "rotary_module" in s)
    assert "self.rotary_inv_freq = rotary_state['inv_freq']" in holding


@pytest.mark.parametrize("name", ["hf_llama_dynamic_rope", "hf_llama_dynamic_rope_short"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_hugging_face_dynamic_rope_is_kept_whole_under_export(name: str, schedule: str, tmp_path: Path) -> None:
    """`LlamaForCausalLM` with `rope_scaling={"rope_type": "dynamic"}`: fx fails on its
    decorated forward, export on `dynamic_rope_update`'s branch on `torch.max(position_ids)`;
    export keeps the rotary embedding whole and the pipeline trains as the original, with
    the batch's length past `max_position_embeddings` (rescaled) and below it."""
    trains_like_original(name, tmp_path / "pkg", steps=3, stages=2, schedule=schedule, microbatches=4)
    plan = (tmp_path / "pkg" / "plan.txt").read_text()
    assert "model.rotary_emb (stage 0): transformers/modeling_rope_utils.py, line " in plan
    assert "`if seq_len > max_seq_len_cached:" in plan
    assert "traced with export" in (tmp_path / "pkg" / "stage_0.py").read_text()


def test_compiling_leaves_a_kept_modules_own_state_as_it_was() -> None:
    """The compiler runs a module kept whole on its own copy: the user's dynamic RoPE keeps
    its cached length, so the model still computes what a fresh one does."""
    import torch

    from partitioner.trace import model_file
    from partitioner.trace.trace import trace

    mf = model_file.load(str(Path(__file__).parent / "models" / "hf_llama_dynamic_rope.py"))
    model, fresh = mf.build(0), mf.build(0)
    args, kwargs = mf.example_inputs()
    traced = trace(model, args, kwargs)
    assert traced.kept and model.model.rotary_emb.max_seq_len_cached == 4
    with torch.no_grad():
        torch.testing.assert_close(model(*args, **kwargs).logits, fresh(*args, **kwargs).logits, rtol=0, atol=0)
