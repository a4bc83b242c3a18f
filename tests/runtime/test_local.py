"""LocalPipeline against the reference model: loss, every gradient, SGD steps, state_dict."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import runtime
from runtime.errors import BatchError, StateDictError

from .conftest import Tiny

RTOL, ATOL = 1e-5, 1e-6


def _reference_grads(t: Tiny) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = t.build()
    inputs, target = t.batch()
    loss = t.loss_fn(model(*inputs), target)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _pipe(t: Tiny, **kwargs: Any) -> runtime.LocalPipeline:
    pipe = runtime.LocalPipeline(t.dir, **kwargs)
    pipe.load_state_dict(t.build().state_dict())
    return pipe


def _assert_grads(pipe: runtime.LocalPipeline, want: dict[str, torch.Tensor], factor: float = 1.0) -> None:
    got = {n: p.grad for n, p in pipe.named_parameters()}
    assert set(got) == set(want)
    for name, g in want.items():
        assert got[name] is not None, name
        torch.testing.assert_close(got[name], g * factor, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


#            stages schedule       microbatches dp virtual
CASES = [
    pytest.param(3, "gpipe", 4, 1, 1, id="3-gpipe-4"),
    pytest.param(3, "1f1b", 4, 1, 1, id="3-1f1b-4"),
    pytest.param(3, "1f1b", 1, 1, 1, id="3-1f1b-1"),
    pytest.param(2, "1f1b", 8, 1, 1, id="2-1f1b-8"),
    pytest.param(4, "gpipe", 2, 1, 1, id="4-gpipe-2"),
    pytest.param(4, "interleaved", 4, 1, 2, id="4-interleaved-v2"),
    pytest.param(2, "1f1b", 4, 2, 1, id="2-1f1b-dp2"),
    # B split in I and W ([Note: split backward] in runtime/stage.py): the same gradients
    pytest.param(3, "zb-h1", 4, 1, 1, id="3-zb-h1-4"),
    pytest.param(4, "zb-h1", 2, 1, 1, id="4-zb-h1-2"),
    pytest.param(3, "zb-h2", 8, 1, 1, id="3-zb-h2-8"),
    pytest.param(2, "zb-h2", 4, 2, 1, id="2-zb-h2-dp2"),
    # two stages per rank in a V ([Note: V placement]): stages 0 and 3 (the tied weight's
    # copies) share rank 0, stages 1 and 2 hand over on rank 1 in memory
    pytest.param(4, "zb-v", 4, 1, 2, id="4-zb-v-4"),
    pytest.param(4, "zb-v", 1, 1, 2, id="4-zb-v-1"),
    pytest.param(4, "zb-v", 8, 2, 2, id="4-zb-v-dp2"),
]


@pytest.mark.parametrize("stages, schedule, microbatches, dp, virtual", CASES)
def test_train_step_matches_reference(make_tiny: Callable[..., Tiny], stages: int, schedule: str, microbatches: int,
                                      dp: int, virtual: int) -> None:
    t = make_tiny(stages=stages, schedule=schedule, microbatches=microbatches, dp=dp, virtual_stages=virtual)
    want_loss, want = _reference_grads(t)
    pipe = _pipe(t)
    loss = pipe.train_step(*t.batch())
    torch.testing.assert_close(loss, want_loss, rtol=RTOL, atol=ATOL)
    assert not loss.requires_grad
    _assert_grads(pipe, want)


def test_schedule_override(tiny: Tiny) -> None:
    want_loss, want = _reference_grads(tiny)
    pipe = _pipe(tiny, schedule="gpipe")
    torch.testing.assert_close(pipe.train_step(*tiny.batch()), want_loss, rtol=RTOL, atol=ATOL)
    _assert_grads(pipe, want)


def test_tied_parameter_is_shared_and_listed_once(tiny: Tiny) -> None:
    pipe = _pipe(tiny)
    assert pipe.runners[0].module.embed_weight is pipe.runners[2].module.embed_weight
    names = [n for n, _ in pipe.named_parameters()]
    assert names.count("embed.weight") == 1 and len(pipe.parameters()) == len(names) == 8


def test_grads_accumulate_like_backward(tiny: Tiny) -> None:
    _, want = _reference_grads(tiny)
    pipe = _pipe(tiny)
    pipe.train_step(*tiny.batch())
    pipe.train_step(*tiny.batch())
    _assert_grads(pipe, want, factor=2.0)


def test_three_sgd_steps_match_reference(tiny: Tiny) -> None:
    model, pipe = tiny.build(), _pipe(tiny)
    inputs, target = tiny.batch()
    opt_ref = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for _ in range(3):
        opt_ref.zero_grad()
        ref = tiny.loss_fn(model(*inputs), target)
        ref.backward()
        opt_ref.step()
        opt.zero_grad()
        loss = pipe.train_step(inputs, target)
        opt.step()
        torch.testing.assert_close(loss, ref.detach(), rtol=RTOL, atol=ATOL)
    want, got = model.state_dict(), pipe.state_dict()
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_state_dict_round_trip(tiny: Tiny) -> None:
    sd = tiny.build().state_dict()
    pipe = _pipe(tiny)
    got = pipe.state_dict()
    assert list(sd) and set(got) == set(sd)  # head.weight (the alias) included
    for name in sd:
        torch.testing.assert_close(got[name], sd[name], rtol=0, atol=0)
    again = runtime.LocalPipeline(tiny.dir)
    again.load_state_dict(got)
    for name, value in again.state_dict().items():
        torch.testing.assert_close(value, sd[name], rtol=0, atol=0)


def test_load_state_dict_through_the_alias_alone(tiny: Tiny) -> None:
    sd = dict(tiny.build().state_dict())
    weight = sd.pop("embed.weight")
    pipe = runtime.LocalPipeline(tiny.dir)
    pipe.load_state_dict(sd)
    torch.testing.assert_close(pipe.state_dict()["embed.weight"], weight, rtol=0, atol=0)


def test_forward_only(tiny: Tiny) -> None:
    model, pipe = tiny.build(), _pipe(tiny)
    inputs, _ = tiny.batch()
    out = pipe(inputs)
    torch.testing.assert_close(out, model(*inputs), rtol=RTOL, atol=ATOL)
    assert not out.requires_grad and all(p.grad is None for p in pipe.parameters())


def test_forward_only_accepts_a_bare_tensor_and_a_dict(tiny: Tiny) -> None:
    model, pipe = tiny.build(), _pipe(tiny)
    x = tiny.batch()[0][0]
    torch.testing.assert_close(pipe(x), model(x), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(pipe({0: x}), model(x), rtol=RTOL, atol=ATOL)


def test_explicit_loss_fn(tiny: Tiny) -> None:
    model, pipe = tiny.build(), _pipe(tiny)
    inputs, target = tiny.batch()

    def l1(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return (out - tgt).abs().mean()

    torch.testing.assert_close(pipe.train_step(inputs, target, loss_fn=l1), l1(model(*inputs), target).detach(),
                               rtol=RTOL, atol=ATOL)


def test_state_dict_errors(tiny: Tiny) -> None:
    pipe = runtime.LocalPipeline(tiny.dir)
    sd = dict(tiny.build().state_dict())
    with pytest.raises(StateDictError, match=r"missing 1 key\(s\): fc2.bias"):
        pipe.load_state_dict({k: v for k, v in sd.items() if k != "fc2.bias"})
    with pytest.raises(StateDictError, match=r"unexpected 1 key\(s\): extra.weight"):
        pipe.load_state_dict({**sd, "extra.weight": torch.zeros(1)})
    with pytest.raises(StateDictError, match=r"state_dict\['fc1.bias'\] has shape \[3\] but the package expects \[16\]"):
        pipe.load_state_dict({**sd, "fc1.bias": torch.zeros(3)})
    pipe.load_state_dict({"fc1.bias": torch.ones(16)}, strict=False)
    assert torch.equal(pipe.state_dict()["fc1.bias"], torch.ones(16))


def test_batch_errors(tiny: Tiny) -> None:
    pipe = _pipe(tiny)
    inputs, target = tiny.batch()
    # the hand-written package lists no free dimension: its batch is fixed
    with pytest.raises(BatchError, match=r"shape \[3, 16\] but .* compiled for \[4, 16\] .* batch is fixed at 16 rows"):
        pipe.train_step((inputs[0][:15],), target[:15])
    with pytest.raises(BatchError, match=r"microbatches of shape \[2, 16\] but the package was compiled for \[4, 16\]"):
        pipe.train_step((inputs[0][:8],), target[:8])
    # fewer rows than microbatches run fewer microbatches ([Note: short batch]), still of the fixed shape
    with pytest.raises(BatchError, match=r"microbatches of shape \[1, 16\] but the package was compiled for \[4, 16\]"):
        pipe.train_step((inputs[0][:2],), target[:2])
    with pytest.raises(BatchError, match=r"the target has 12 rows along dim 0 but the inputs have 16"):
        pipe.train_step(inputs, target[:12])
    with pytest.raises(BatchError, match=r"reads input 0 \(x\) but the batch has 'y'"):
        pipe({"y": inputs[0]})


def test_device_placement_on_cpu(tiny: Tiny) -> None:
    """device= takes one device, one per stage or one per rank; CUDA paths are not taken on CPU."""
    _, want = _reference_grads(tiny)
    for device in ("cpu", ["cpu"] * 3, [torch.device("cpu")] * 3):
        pipe = _pipe(tiny, device=device)
        pipe.train_step(*tiny.batch())
        _assert_grads(pipe, want)
    with pytest.raises(runtime.PipelineError, match="device= lists 2 devices but the package has 3 stages on 3 ranks"):
        runtime.LocalPipeline(tiny.dir, device=["cpu", "cpu"])
    if not torch.cuda.is_available():
        with pytest.raises(runtime.PipelineError, match="CUDA is not available"):
            runtime.LocalPipeline(tiny.dir, device="cuda:0")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stages_on_gpus(tiny: Tiny) -> None:
    """Stage k on cuda:k (wrapping around the GPUs there are): same loss and gradients."""
    want_loss, want = _reference_grads(tiny)
    devices = [f"cuda:{k % torch.cuda.device_count()}" for k in range(3)]
    pipe = _pipe(tiny, device=devices)
    loss = pipe.train_step(*tiny.batch())
    torch.testing.assert_close(loss.cpu(), want_loss, rtol=RTOL, atol=ATOL)
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), want[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(pipe(tiny.batch()[0]).cpu(), tiny.build()(*tiny.batch()[0]), rtol=1e-4, atol=1e-5)
