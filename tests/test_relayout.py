"""poetxq.model.relayout: a built model's storages copied out and back keep values, identity and
sharing.

The oracle is a twin model and optimizer built from the same seeds and left in place: after the
relayout, two training steps on each must give identical parameters.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("bitsandbytes")

from poetxq.model.relayout import expandable_segments, model_tensors, relayout, relayout_wanted
from poetxq.model.surgery import build_llama, convert_to_poetx
from poetxq.training.evaluate import causal_lm_loss
from poetxq.training.optim import build_optimizer
from poetxq.training.recipe_files import load_recipe


def _built():
    over = {"model.hidden_size": 64, "model.intermediate_size": 128,
            "model.num_attention_heads": 4, "model.num_hidden_layers": 2,
            "poet.block_size": 16, "poet.bits": 8, "optim.state_bits": 8,
            "train.batch_size": 2, "train.seq_len": 16}  # fmt: skip
    recipe = load_recipe(None, over)
    torch.manual_seed(0)
    model = build_llama(recipe.model, 96)
    convert_to_poetx(model, recipe.poet, generator=torch.Generator().manual_seed(0))
    model.train()
    return model, build_optimizer(model, recipe.optim)


def _step(model, optimizer, windows) -> None:
    causal_lm_loss(model, windows).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_relayout_keeps_values_identity_and_shared_storage_then_trains_the_same():
    model, opt = _built()
    ref_model, ref_opt = _built()  # the same seeds: an identical twin, never relaid
    flats = opt.flat_groups
    assert flats and all(f.intact() for f in flats)
    tensors = model_tensors(model, opt)
    ids = [id(t) for t in tensors]
    before = {n: t.clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    old = [t.untyped_storage() for t in tensors]  # kept alive: new storages land elsewhere
    old_ptrs = {s.data_ptr() for s in old}
    storages_before = len(old_ptrs)

    report = relayout(tensors, "cpu")

    assert [id(t) for t in model_tensors(model, opt)] == ids  # the same objects, re-pointed
    assert report.storages == storages_before
    assert report.bytes == sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values()
    )
    new_ptrs = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(new_ptrs) == storages_before and not new_ptrs & old_ptrs
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.equal(t, before[n]), n
    # flattened parameters are still views of their group's buffer (one storage each)
    assert all(f.intact() for f in flats)
    for f in flats:
        assert {p.untyped_storage().data_ptr() for p in f.params} == {
            f.flat.untyped_storage().data_ptr()
        }
    # the optimizer still holds the very parameters (its groups were not rebuilt)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for p in model.parameters() if p.requires_grad}

    windows = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        _step(model, opt, windows)
        _step(ref_model, ref_opt, windows)
    for (n, a), b in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b), n
    assert any(not torch.equal(a, before[n]) for n, a in model.named_parameters())


def test_relayout_leaves_tensors_of_other_devices_and_empty_input_alone():
    t = torch.arange(6.0)
    report = relayout([t], "meta")
    assert report.storages == 0 and report.bytes == 0
    assert torch.equal(t, torch.arange(6.0))
    assert relayout([], "cpu").storages == 0


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, False),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:true"}, True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}, False),
    ],
)
def test_relayout_is_wanted_on_cuda_with_expandable_segments_and_flat_groups_only(
    monkeypatch, env, want
):
    """Only flattening frees the ``Q`` tensors whose holes the relayout closes: an optimizer
    without flat groups (the lowest plan's offloaded one) never wants it."""
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    flat, unflat = SimpleNamespace(flat_groups=[object()]), SimpleNamespace(flat_groups=[])
    assert expandable_segments() is want
    assert relayout_wanted("cuda", flat) is want
    assert relayout_wanted("cuda", unflat) is False and relayout_wanted("cuda", None) is False
    assert relayout_wanted(torch.device("cpu"), flat) is False


@pytest.mark.slow
def test_train_with_the_relayout_gives_the_losses_of_a_run_without(tiny_train, monkeypatch, capsys):
    """The trainer's relayout (forced on the CPU) changes no number of a 3-step run with a merge."""
    import poetxq.model.relayout as relayout_mod

    extra = ("--set", "optim.warmup_steps=1", "--set", "optim.state_bits=8",
             "--set", "train.precision=fp32")  # fmt: skip

    want, _ = tiny_train("plain", *extra)
    assert "laid out afresh" not in capsys.readouterr().out
    import poetxq.training.plan as plan_mod

    # the run plan decides (poetxq.training.plan); relayout_wanted still checks the optimizer
    monkeypatch.setattr(plan_mod, "relayout_planned", lambda device, allocator=None: True)
    monkeypatch.setattr(relayout_mod, "relayout_wanted", lambda device, optimizer: True)
    got, _ = tiny_train("relaid", *extra)
    assert "device memory laid out afresh (expandable segments)" in capsys.readouterr().out
    assert len(want) == 3 and got == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_relayout_on_cuda_moves_every_byte_out_and_back_in_order():
    """On the GPU: while the storages are on the host none of their bytes stay allocated, no
    more is allocated afterwards than before, and values and flat views are intact."""
    over = {"model.hidden_size": 64, "model.intermediate_size": 128,
            "model.num_attention_heads": 4, "model.num_hidden_layers": 2,
            "poet.block_size": 16, "poet.bits": 8, "optim.state_bits": 8}  # fmt: skip
    recipe = load_recipe(None, over)
    torch.manual_seed(0)
    model = build_llama(recipe.model, 96)
    convert_to_poetx(model, recipe.poet, generator=torch.Generator().manual_seed(0))
    model.to("cuda")
    opt = build_optimizer(model, recipe.optim)
    before = {n: t.clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    report = relayout(model_tensors(model, opt), "cuda")
    # freed blocks are rounded up from the storages' sizes: at least report.bytes went
    assert report.left_on_device <= allocated - report.bytes
    assert torch.cuda.memory_allocated() <= allocated + 2**20  # nothing duplicated
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t.is_cuda and torch.equal(t, before[n]), n
    assert all(f.intact() for f in opt.flat_groups)
