"""Golden packages: the emitted files of four small examples, compared byte for byte.

Costs are analytic on the a100 profile, so the plan and every number are deterministic.
Regenerate on purpose with `pytest tests/codegen/test_golden.py --update-golden` and
review the diff like code.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ..conftest import ROOT, compile_example

GOLDEN = ROOT / "tests" / "golden"
CASES = {
    "mlp_3stages_1f1b": ("examples/mlp.py", {"stages": 3, "schedule": "1f1b"}),
    "skip_2stages_gpipe": ("examples/skip.py", {"stages": 2, "schedule": "gpipe"}),
    "hf_gpt2_2stages_1f1b": ("examples/hf_gpt2.py", {"stages": 2, "schedule": "1f1b"}),
    # tensor parallel: Megatron's split of a GPT wide enough for it to pay on an A100
    "gpt_wide_2stages_tp2": ("tests/model_files/gpt_wide.py", {"stages": 2, "tp": 2, "microbatches": 2}),
}
TEXT_FILES = ("manifest.json", "plan.txt", "__init__.py")


@pytest.mark.parametrize("case", sorted(CASES))
def test_package_matches_golden(case: str, tmp_path: Path, update_golden: bool) -> None:
    path, options = CASES[case]
    out = tmp_path / case
    compile_example(path, out, **options)
    golden = GOLDEN / case
    produced = sorted(p.name for p in out.iterdir() if p.name in TEXT_FILES or p.name.startswith("stage_"))
    if update_golden:
        shutil.rmtree(golden, ignore_errors=True)
        golden.mkdir(parents=True)
        for name in produced:
            shutil.copy(out / name, golden / name)
        pytest.skip(f"rewrote {golden}")
    assert golden.is_dir(), f"no golden copy of {case}: run pytest with --update-golden"
    assert produced == sorted(p.name for p in golden.iterdir())
    for name in produced:
        assert (out / name).read_text() == (golden / name).read_text(), (
            f"{case}/{name} differs from tests/golden: if the change is intended, rerun with --update-golden"
        )
