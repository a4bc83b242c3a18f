"""A peak FLOP/s per dtype ([Note: a peak per dtype] in partitioner/cost/hardware.py): a
profile with per-dtype peaks round-trips, one with a single peak still loads, and plans
of one model in fp32 and bf16 predict compute-bound steps in the ratio of those peaks."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from partitioner.cost.hardware import load_hardware
from partitioner.cost.waves import busy_fraction
from runtime.manifest import Manifest

from ..conftest import compile_example

#: wide matmuls, compute-bound on an A100 in either precision, with no messages (one stage)
#: and a narrow output, so that the loss (memory-bound) is a thousandth of the step
WIDE = '''
import torch

def build_model():
    layers = [torch.nn.Linear(8192, 8192, bias=False) for _ in range(3)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(8192, 1024, bias=False))

def example_inputs():
    return (torch.randn(4096, 8192),)

def example_target():
    return torch.randn(4096, 1024)

def loss_fn(out, target):
    return torch.nn.functional.mse_loss(out, target)
'''


def test_a_profile_with_a_peak_per_dtype_round_trips(tmp_path: Path) -> None:
    hw = dataclasses.replace(load_hardware("a100"), name="mine", tf32=True)
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(dataclasses.asdict(hw)))
    back = load_hardware(str(path))
    assert back == hw
    assert (back.peak_for(torch.bfloat16), back.peak_for(torch.float16)) == (312e12, 312e12)
    assert back.peak_for(torch.float32) == 156e12  # TF32 assumed
    assert back.precision_peak("fp32") == ("tf32", 156e12)
    assert dataclasses.replace(back, tf32=False).precision_peak("fp32") == ("fp32", 19.5e12)


@pytest.mark.parametrize("name,bf16,tf32,fp32", [("a100", 312e12, 156e12, 19.5e12), ("h100", 989e12, 495e12, 67e12),
                                                ("h200", 989e12, 495e12, 67e12)])
def test_builtin_profiles_give_each_dtype_its_datasheet_peak(name: str, bf16: float, tf32: float, fp32: float) -> None:
    hw = load_hardware(name)
    assert (hw.peak_flops, hw.peak_flops_tf32, hw.peak_flops_fp32, hw.tf32) == (bf16, tf32, fp32, False)
    assert hw.peak_for(torch.float32) == fp32  # PyTorch's default: allow_tf32 is False for matmuls
    assert hw.precision_peak("bf16-mixed") == ("bf16", bf16) and hw.precision_peak("fp16-mixed") == ("fp16", bf16)


def test_a_profile_with_a_single_peak_still_loads(tmp_path: Path) -> None:
    raw = json.loads(Path("partitioner/profiles/a100.json").read_text())
    for key in ("peak_flops_fp32", "peak_flops_tf32", "tf32"):
        del raw[key]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(raw))
    hw = load_hardware(str(path))
    assert hw.peak_for(torch.float32) == hw.peak_for(torch.bfloat16) == 312e12  # charged as before


def test_a_profile_whose_tf32_is_not_a_flag_is_refused(tmp_path: Path) -> None:
    from partitioner.errors import PartitionerError

    raw = json.loads(Path("partitioner/profiles/a100.json").read_text())
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**raw, "tf32": "yes"}))
    with pytest.raises(PartitionerError, match=r"field 'tf32' must be true or false, not 'yes'.*copy partitioner"):
        load_hardware(str(path))


def test_fp32_and_bf16_plans_predict_steps_in_the_ratio_of_the_peaks(tmp_path: Path) -> None:
    """The same compute-bound model on a100: fp32 matmuls at 19.5 TFLOP/s, bf16 ones at
    312, so the fp32 step takes 16 times as long; each MFU is of its own precision's peak,
    and both are the profile's efficiency (0.75) times what the products' waves keep busy
    ([Note: waves of tiles] in partitioner/cost/waves.py): 1024 x 8192 outputs are 256
    tiles, 3 waves of 108 on an A100 (0.79 busy); the 1024 x 1024 head's 32 tiles, less than a
    wave, are spread by smaller tiles (all busy)."""
    model = tmp_path / "wide.py"
    model.write_text(WIDE)
    steps, mfus = {}, {}
    for precision in ("fp32", "bf16"):
        compile_example(str(model), tmp_path / precision, stages=1, microbatches=4, precision=precision, meta=True)
        manifest = Manifest.from_json((tmp_path / precision / "manifest.json").read_text())
        assert manifest.predicted is not None
        steps[precision], mfus[precision] = manifest.predicted.step_time_s, manifest.predicted.mfu
        assert manifest.predicted.extra["mfu_peak"] == precision
        assert f"of the {precision} peak" in (tmp_path / precision / "plan.txt").read_text()
    assert steps["fp32"] / steps["bf16"] == pytest.approx(312 / 19.5, rel=0.002)
    hw = load_hardware("a100")
    busy = [busy_fraction(1, 1024, n, hw.sm_count, hw.gemm_tile_m, hw.gemm_tile_n) for n in (8192, 1024)]
    assert busy[0] == pytest.approx(256 / 324) and busy[1] == 1.0
    want = hw.efficiency * 25 / (24 / busy[0] + 1 / busy[1])  # three 8192 x 8192 layers: 24 of 25 FLOPs
    assert mfus["fp32"] == pytest.approx(mfus["bf16"], rel=0.002) and mfus["bf16"] == pytest.approx(want, rel=0.002)
