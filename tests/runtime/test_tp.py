"""Tensor parallelism: runtime/tp.py's collectives and DistributedPipeline with tp > 1.

The multi-process tests run real gloo ranks (test_distributed.launch): each compares its
loss, its gradient shards, the forward output and the weights after 3 SGD steps with
the original model (tp_package.py's TpNet) in that process.
LocalPipeline with tp > 1 (in-process lanes) is tested in test_local_tp.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import runtime
from runtime import package, tp
from runtime.errors import ManifestError, MeshError, PipelineError
from runtime.manifest import Manifest, Mesh, ParamSpec, Shard, Source, StageOutput, StageSpec

from .test_distributed import WORKER, _ok, launch, multiproc
from .tp_package import write_tp_package

MODEL = "tp_net.py"


# -- in one process -------------------------------------------------------------------------


def test_without_a_group_every_function_is_the_identity() -> None:
    tp.reset()
    x = torch.randn(4, 6)
    assert (tp.rank(), tp.size()) == (0, 1)
    for y in (tp.all_reduce(x), tp.copy(x), tp.all_gather(x, 1), tp.scatter(x, 1, blocks=3)):
        assert y is x
    local, outside = tp.vocab_shard(torch.tensor([0, 5, 9]), 10)
    assert local.tolist() == [0, 5, 9] and not outside.any()


def test_set_group_checks_the_rank() -> None:
    with pytest.raises(PipelineError, match=r"tp.set_group: rank 2 is not in a group of 2"):
        tp.set_group(None, 2, 2)
    tp.reset()


def test_shards_with_blocks_round_trip() -> None:
    qkv = torch.arange(12.0).reshape(12, 1)  # q = 0..3, k = 4..7, v = 8..11
    shards = [tp.local_shard(qkv, 0, i, 2, blocks=3) for i in range(2)]
    assert shards[0].flatten().tolist() == [0, 1, 4, 5, 8, 9]
    assert torch.equal(tp.join_shards(shards, 0, blocks=3), qkv)
    with pytest.raises(PipelineError, match=r"does not split into 3 block\(s\) x 3 tensor-parallel shards"):
        tp.local_shard(qkv, 0, 0, 3, blocks=3)


def test_blocked_shards_load_and_reassemble() -> None:
    spec = ParamSpec("qkv_weight", "qkv.weight", (6, 2), shard=Shard(0, "tp", 2, 3))
    entry = StageSpec(0, "stage_0", "Stage0", (0, 1), (), (StageOutput("output", None, None),), (spec,))
    manifest = Manifest(Source("qkv.py"), Mesh(1, 2), "gpipe", 1, (), (entry,))
    full = torch.arange(24.0).reshape(12, 2)
    mine = [torch.zeros(6, 2), torch.zeros(6, 2)]
    pieces = []
    for t, tensor in enumerate(mine):
        module = torch.nn.Module()
        module.qkv_weight = torch.nn.Parameter(tensor)
        got = package.stage_tensors(module, entry, tp_rank=t)
        assert got[0][0].shard.index == t and spec.shard.index == "tp"  # a resolved copy
        package.load_stage_state(got, {"qkv.weight": full}, manifest)
        pieces += got
    assert torch.equal(mine[1], full[[2, 3, 6, 7, 10, 11]])
    assert torch.equal(package.assemble_state_dict(pieces, manifest)["qkv.weight"], full)
    with pytest.raises(runtime.PipelineError, match=r"has shape \[10, 2\] but the package expects \[12, 2\] \(its "
                                                    r"qkv_weight, of which each rank holds 1 of 2 tensor-parallel "
                                                    r"shards along dim 0: \[6, 2\]\)"):
        package.load_stage_state(got, {"qkv.weight": torch.zeros(10, 2)}, manifest)


def test_tp_package_with_tp_1_runs_locally(tmp_path: Path) -> None:
    """The Megatron-style stage code is plain PyTorch when tp = 1 (no group: identities)."""
    pkg = write_tp_package(tmp_path, stages=2, tp=1)
    model_file = package.load_model_file(package.load_manifest(pkg), pkg)
    torch.manual_seed(0)
    model = model_file.build_model()
    pipe = runtime.LocalPipeline(pkg)
    pipe.load_state_dict(model.state_dict())
    inputs, target = model_file.example_inputs(), model_file.example_target()
    ref = model_file.loss_fn(model(*inputs), target)
    ref.backward()
    torch.testing.assert_close(pipe.train_step(inputs, target), ref.detach(), rtol=1e-5, atol=1e-6)
    grads = dict(model.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-6)


def test_world_size_must_be_pp_x_tp_x_dp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = write_tp_package(tmp_path, stages=2, tp=2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(MeshError, match=r"planned for pp=2 x tp=2 x dp=1 = 4 ranks but WORLD_SIZE is 2: launch 4 "
                                        r"processes \(--nproc 4\)"):
        runtime.DistributedPipeline(pkg)


def test_manifest_shards_are_checked(tmp_path: Path) -> None:
    pkg = write_tp_package(tmp_path, stages=2, tp=2)
    file = pkg / "manifest.json"
    good = json.loads(file.read_text())
    bad = json.loads(file.read_text())
    bad["stages"][0]["parameters"][1]["shard"]["count"] = 4
    file.write_text(json.dumps(bad))
    with pytest.raises(ManifestError, match=r"stage 0's 'fc1_weight' is cut in 4 shards but mesh.tp is 2"):
        package.load_manifest(pkg)
    bad = json.loads(json.dumps(good))
    bad["stages"][1]["parameters"][2]["shard"] = {"dim": None, "index": 0, "count": 1}
    file.write_text(json.dumps(bad))
    with pytest.raises(ManifestError, match=r"the copies of tied parameter\(s\) wte.weight differ in shape or shard"):
        package.load_manifest(pkg)


# -- in several processes -----------------------------------------------------------------


@multiproc
@pytest.mark.timeout(120)
def test_collectives_match_one_process(tmp_path: Path) -> None:
    """all_reduce/copy, column- and row-parallel linears, blocks=3, vocab_shard (tp_checks.py)."""
    assert WORKER.with_name("tp_checks.py").is_file()
    model = tmp_path / "unused.py"
    model.write_text("")
    _ok(launch(2, "tp", [tmp_path], model))


@multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stages, dp, schedule", [(1, 1, "1f1b"), (2, 1, "1f1b"), (1, 2, "gpipe")],
                         ids=["tp2", "pp2-tp2", "dp2-tp2"])
def test_tensor_parallel_matches_the_model(tmp_path: Path, stages: int, dp: int, schedule: str) -> None:
    pkg = write_tp_package(tmp_path, stages=stages, tp=2, dp=dp, microbatches=2, schedule=schedule)
    _ok(launch(stages * 2 * dp, "check", [pkg], tmp_path / MODEL))


@multiproc
@pytest.mark.timeout(120)
def test_a_silent_tp_peer_is_named(tmp_path: Path) -> None:
    pkg = write_tp_package(tmp_path, stages=1, tp=2)
    ranks = launch(2, "fault", [pkg], tmp_path / MODEL, env={"PIPELINE_FAULT": "1:0F0:hang", "PIPELINE_TIMEOUT_S": "2"})
    assert ranks[0].rc == 3 and ranks[1].rc == -9, ranks[0].err[-2000:]
    assert re.search(r"rank 0 \(tp index 0\) timed out in the tensor-parallel all_reduce during 0F0 \(stage 0, "
                     r"microbatch 0\): rank 1 \(tp index 1\) of its tensor-parallel group stopped or failed \(.+\)\. "
                     r".*raise PIPELINE_TIMEOUT_S \(now 2 s\)", ranks[0].err), ranks[0].err
