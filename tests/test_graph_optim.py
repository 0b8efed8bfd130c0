"""poetxq.training.graph_optim: the optimizer step inside backward, in a form a CUDA graph can
replay.

Oracle: the run's own 8-bit AdamW (``adamw8bit_class``, flattened group, the Triton update with
host scalars) stepping after an ordinary backward; for the fp32-moment tensors, bitsandbytes'
own 32-bit step. On the CPU the hooks run eagerly (Triton's interpreter); a GPU test replays them
from a captured graph.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

bnb = pytest.importorskip("bitsandbytes")

from poetxq.training.graph_optim import GraphedInBackward, hooks_for  # noqa: E402
from poetxq.training.lowmem import OptimizerInBackward  # noqa: E402
from poetxq.training.optim import adamw8bit_class, reset_orthogonal_state  # noqa: E402
from quant_kernels.policy import KernelPolicy  # noqa: E402

#: the eager reference's flat step through the Triton update, on the CPU in the interpreter
TRITON_UPDATE = KernelPolicy(interpret_on_cpu=True)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# >= 4096 elements: 8-bit moments (300-wide rows leave gaps in the flat buffer); 100: fp32 moments
SHAPES_8BIT = [(20, 300), (4096,), (513, 8)]
SHAPE_32BIT = (100,)
LRS = [1e-2, 3e-3, 2e-2, 5e-3, 1e-2]  # a schedule: the learning rate changes every step

pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered"),  # interpreter: masked 0/0
    pytest.mark.skipif(
        DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
        reason="Triton kernels on CPU tensors need its interpreter (TRITON_INTERPRET=1)",
    ),
]


def _setup(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(*s, generator=gen).to(DEV)) for s in SHAPES_8BIT]
    small = nn.Parameter(torch.randn(*SHAPE_32BIT, generator=gen).to(DEV))
    opt = adamw8bit_class()([{"params": params, "lr": LRS[0], "weight_decay": 0.1},
                             {"params": [small], "lr": LRS[0], "weight_decay": 0.05}],
                            kernels=TRITON_UPDATE)  # fmt: skip
    opt.flatten_group(0)  # the Q group of a POET model is flattened
    return [*params, small], opt


def _loss(params: list[nn.Parameter], step: int) -> torch.Tensor:
    """A loss whose gradient is a fixed random tensor per parameter and step."""
    gen = torch.Generator().manual_seed(100 + step)
    total = torch.zeros((), device=DEV)
    for i, p in enumerate(params):
        g = (torch.randn(p.shape, generator=gen) * (1 + i)).to(DEV)
        total = total + (p * g).sum()
    return total


def _set_lr(opt, step: int) -> None:
    for group in opt.param_groups:
        group["lr"] = LRS[step]


def _step_both(ref, opt_ref, mine, hooks: GraphedInBackward, step: int) -> None:
    """One step of both: the reference steps after its backward, the hooks inside theirs."""
    _set_lr(opt_ref, step)
    _set_lr(hooks.optimizer, step)
    _loss(ref, step).backward()
    opt_ref.step()
    opt_ref.zero_grad(set_to_none=True)
    hooks.before_replay()
    _loss(mine, step).backward()
    hooks.after_replay()


def _close(ref: list[torch.Tensor], mine: list[torch.Tensor], opt_ref, opt) -> None:
    for a, b in zip(ref, mine, strict=True):
        sa, sb = opt_ref.state[a], opt.state[b]
        if sa["state1"].dtype == torch.uint8:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        else:  # bitsandbytes' CUDA 32-bit kernel takes beta**t from fp32 powf, we (as its Triton
            # 8-bit kernel) from float64: 1 - beta2**t then differs by up to ~1e-4 relative
            torch.testing.assert_close(b, a, rtol=2e-4, atol=1e-5)
        assert sa["step"] == sb["step"]
        for key in ("state1", "state2"):
            if sa[key].dtype == torch.uint8:  # codes: equal but where a value sits on a midpoint
                assert (sa[key] == sb[key]).float().mean() > 0.99, key
            else:  # fp32 moments: bitsandbytes' CUDA kernel computes 1 - beta in fp32, as
                # ours does; its CPU op in float64 (1 - beta2 then differs by 1.3e-5 relative)
                rtol = 1e-5 if DEV == "cuda" else 3e-5
                torch.testing.assert_close(sb[key], sa[key], rtol=rtol, atol=1e-7)


def test_hooks_follow_the_step_after_backward_across_a_schedule_and_a_reset(monkeypatch):
    ref, opt_ref = _setup(monkeypatch)
    mine, opt = _setup(monkeypatch)
    hooks = GraphedInBackward(opt)
    hooks.prepare()
    owned = [opt.state[p]["state1"].data_ptr() for p in mine]
    start = [p.detach().clone() for p in mine]
    for step in range(len(LRS)):
        if step == 3:  # a merge resets the moments of Q (the flattened group) on both sides
            reset_orthogonal_state(opt_ref, ref[:3])
            reset_orthogonal_state(opt, mine[:3])
        _step_both(ref, opt_ref, mine, hooks, step)
        assert all(p.grad is None for p in mine)  # each gradient freed after its update
        assert hooks.reset_count() == len(mine)
    assert opt.state[mine[0]]["step"] == 2  # restarted at the reset, two steps since
    # the graph's state tensors were kept (zeroed in place at the reset, not replaced)
    assert [opt.state[p]["state1"].data_ptr() for p in mine] == owned
    for p, p0 in zip(mine, start, strict=True):
        assert (p - p0).abs().max() > 1e-2  # every parameter moved
    _close(ref, mine, opt_ref, opt)


def test_rehearsal_compiles_without_changing_anything(monkeypatch):
    params, opt = _setup(monkeypatch)
    hooks = GraphedInBackward(opt)
    hooks.prepare()
    hooks.before_replay()
    before = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
              for p in params]  # fmt: skip
    calls = []
    monkeypatch.setattr(
        "poetxq.training.graph_optim._update", lambda *a: calls.append(a[0].data_ptr())
    )
    with hooks.rehearsal():  # the update runs on the real tensors (their alignment) ...
        _loss(params, 0).backward()
    assert sorted(calls) == sorted(p.data_ptr() for p in params)
    monkeypatch.undo()
    with hooks.rehearsal():  # ... and what it wrote is put back
        _loss(params, 0).backward()
    assert hooks.reset_count() == 0 and hooks.active is None
    assert all(p.grad is None for p in params)
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p.detach(), b)
    for p, saved in zip(params, states, strict=True):
        for k, v in saved.items():
            assert torch.equal(opt.state[p][k], v), k


def test_a_loaded_state_is_copied_into_the_graphs_tensors(monkeypatch):
    ref, opt_ref = _setup(monkeypatch)
    mine, opt = _setup(monkeypatch)
    hooks = GraphedInBackward(opt)
    hooks.prepare()
    owned = opt.state[mine[1]]["state2"]
    for step in range(2):
        _loss(ref, step).backward()
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
    opt.load_state_dict(opt_ref.state_dict())  # a resume: new state tensors
    with torch.no_grad():
        for a, b in zip(ref, mine, strict=True):
            b.copy_(a)
    for step in (2, 3):
        _step_both(ref, opt_ref, mine, hooks, step)
    assert opt.state[mine[1]]["state2"] is owned  # copied in, not replaced
    assert opt.state[mine[1]]["step"] == 4
    _close(ref, mine, opt_ref, opt)


def test_only_the_parameters_the_capture_updated_advance_their_step(monkeypatch):
    """A parameter the captured backward never reaches keeps step 0 and zero moments (as
    bitsandbytes, which makes no state for it); a non-contiguous parameter is made contiguous."""
    params, opt = _setup(monkeypatch)
    odd = nn.Parameter(torch.randn(80, 64).to(DEV).t())  # 5120 elements: 8-bit, not contiguous
    unused = nn.Parameter(torch.randn(4096).to(DEV))
    opt.add_param_group({"params": [odd, unused], "lr": 1e-2, "weight_decay": 0.0})
    hooks = GraphedInBackward(opt)
    hooks.prepare()
    assert odd.is_contiguous()
    start = odd.detach().clone()
    for step in range(3):  # the first backward stands for the capture: it fixes `active`
        if step:
            hooks.before_replay()
        (_loss(params, step) + (odd * 2).sum()).backward()
        assert hooks.reset_count() == len(params) + 1
    assert hooks.active == {id(p) for p in [*params, odd]}
    assert opt.state[unused]["step"] == 0 and not opt.state[unused]["absmax1"].any()
    assert opt.state[odd]["step"] == 2 and (odd - start).abs().min() > 1e-3


def test_graph_hooks_refuse_other_optimizers():
    p = nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"needs the 8-bit AdamW .* not AdamW; set"):
        GraphedInBackward(torch.optim.AdamW([p]))
    assert isinstance(hooks_for(torch.optim.AdamW([p]), graph=False), OptimizerInBackward)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_replayed_graph_applies_each_steps_learning_rate(monkeypatch):
    """The same steps from a captured graph: its replays read the new learning rates."""
    from poetxq.training.cudagraph import GraphedMicroStep

    ref, opt_ref = _setup(monkeypatch)
    mine, opt = _setup(monkeypatch)
    hooks = GraphedInBackward(opt)
    grads = [torch.randn(p.shape, device=DEV) for p in mine]

    def loss_fn(batch: torch.Tensor) -> torch.Tensor:
        return sum((p * g * batch.sum()).sum() for p, g in zip(mine, grads, strict=True))

    one = torch.ones(1, device=DEV)
    graphed = GraphedMicroStep(loss_fn, one, mine, in_backward=hooks)
    for step in range(len(LRS)):
        _set_lr(opt_ref, step)
        _set_lr(opt, step)
        for p, g in zip(ref, grads, strict=True):
            p.grad = g.clone()
        opt_ref.step()
        graphed(one)
    torch.cuda.synchronize()
    _close(ref, mine, opt_ref, opt)


def test_lm_head_updated_slice_by_slice_equals_the_whole_update(monkeypatch):
    """The chunked loss hands the LM head's gradient over by rows (poetxq.training.loss); the hooks
    update each slice's rows and state blocks at once: the same result as the optimizer stepping
    on the whole gradient after the backward."""
    from poetxq.training import loss as loss_mod
    from poetxq.training.loss import ChunkedLinearCrossEntropy

    monkeypatch.setattr(loss_mod, "SLICE_BYTES", 6 * 64 * 4)  # 6 rows asked: 4 (the alignment)
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(96, 64, generator=gen) * 0.1  # 6144 elements: 8-bit moments
    hidden = torch.randn(384, 64, generator=gen).to(DEV)
    # every row a label 4 times: no row's second moment is so far below its block's absmax
    # that it rounds to code 0 (then its next step is ~10 lr, and a rounding-level difference
    # in the gradient decides it: 8-bit Adam's known weakness on rare rows)
    labels = (torch.arange(384) % 96).to(DEV)

    def make():
        w = nn.Parameter(w0.clone().to(DEV))
        opt = adamw8bit_class()([{"params": [w], "lr": LRS[0], "weight_decay": 0.1}],
                                kernels=TRITON_UPDATE)  # fmt: skip
        opt.flatten_group(0)  # the reference: our whole-tensor Triton update after backward
        return w, opt

    ref, opt_ref = make()
    mine, opt = make()
    hooks = GraphedInBackward(opt)
    hooks.prepare()
    calls = []
    real = hooks.update_elements

    def spy(p, lo, hi, g):
        calls.append((lo, hi))
        real(p, lo, hi, g)

    monkeypatch.setattr(hooks, "update_elements", spy)
    for step in range(3):
        _set_lr(opt_ref, step)
        _set_lr(opt, step)
        ChunkedLinearCrossEntropy.apply(hidden, ref, labels, 16).backward()
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
        hooks.before_replay()
        ChunkedLinearCrossEntropy.apply(hidden, mine, labels, 16).backward()
        hooks.after_replay()
        assert mine.grad is None
        assert hooks.reset_count() == 1  # one parameter finished, in 24 slices
    assert calls[:24] == [(r * 64, (r + 4) * 64) for r in range(0, 96, 4)]
    assert opt.state[mine]["step"] == 3
    assert (mine - w0.to(DEV)).abs().max() > 1e-3
    # the slices' GEMMs round the gradient differently from the whole one's: a state code on a
    # midpoint may flip, moving its element by a small fraction of lr
    torch.testing.assert_close(mine, ref, rtol=0, atol=1e-5)
    assert (mine - ref).abs().median() < 1e-6  # rounding elsewhere (1e-4 of a step)
    for key in ("state1", "state2"):
        assert (opt.state[mine][key] == opt_ref.state[ref][key]).float().mean() > 0.99, key
    hooks.remove()  # and the loss stops slicing
    ChunkedLinearCrossEntropy.apply(hidden, mine, labels, 16).backward()
    assert mine.grad is not None and len(calls) == 72


def test_a_slice_that_cuts_a_state_block_is_refused(monkeypatch):
    params, opt = _setup(monkeypatch)
    hooks = GraphedInBackward(opt)
    hooks.prepare()
    p = params[1]  # 4096 elements
    with pytest.raises(ValueError, match=r"elements \[100, 4096\) .* cut an 8-bit state block"):
        hooks.update_elements(p, 100, 4096, torch.zeros(3996, device=DEV))
