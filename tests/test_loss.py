"""The chunked linear + cross-entropy equals the unchunked loss and gradients, keeps no logits."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from poetxq.model.config import ModelConfig
from poetxq.model.surgery import build_llama
from poetxq.training.evaluate import causal_lm_loss
from poetxq.training.loss import ChunkedLinearCrossEntropy, causal_lm_loss_chunked

N, D, V = 37, 16, 50
VOCAB = 101
CFG = ModelConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_hidden_layers=2, max_position_embeddings=64)  # fmt: skip


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error ``‖a − ref‖ / ‖ref‖`` in float64."""
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm()).item()


def _inputs(gen, n=N, dtype=torch.float32):
    h = torch.randn(n, D, generator=gen).to(dtype).requires_grad_()
    w = (0.5 * torch.randn(V, D, generator=gen)).to(dtype).requires_grad_()
    y = torch.randint(0, V, (n,), generator=gen)
    return h, w, y


def _reference64(h, w, y):
    """Loss and (hidden, weight) gradients in float64 through autograd."""
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    loss = F.cross_entropy(h64 @ w64.T, y)
    loss.backward()
    return loss.detach(), h64.grad, w64.grad


@pytest.mark.parametrize("chunk", [8, 1, N, 1000])
def test_fp32_equals_float64_reference(gen, chunk):
    h, w, y = _inputs(gen)
    loss = ChunkedLinearCrossEntropy.apply(h, w, y, chunk)
    assert loss.dtype == torch.float32 and loss.shape == ()
    (3.0 * loss).backward()  # a non-unit grad_out
    ref_loss, ref_h, ref_w = _reference64(h, w, y)
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * ref_loss.item()
    assert h.grad.dtype == w.grad.dtype == torch.float32
    assert _rel(h.grad, 3.0 * ref_h) < 1e-6
    assert _rel(w.grad, 3.0 * ref_w) < 1e-6


def test_bf16_autocast_matches_unchunked_under_autocast(gen):
    h, w, y = _inputs(gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ChunkedLinearCrossEntropy.apply(h, w, y, 8)
    loss.backward()
    got = loss.detach(), h.grad, w.grad
    h.grad = w.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = h @ w.T
        assert logits.dtype == torch.bfloat16
        ref = F.cross_entropy(logits.float(), y)
    ref.backward()
    assert loss.dtype == torch.float32
    assert abs(got[0].item() - ref.item()) <= 1e-5 * ref.item()
    assert got[1].dtype == got[2].dtype == torch.float32
    assert _rel(got[1], h.grad) < 1e-2
    assert _rel(got[2], w.grad) < 1e-2
    # the bf16 logits are what makes it differ from the fp32 loss
    assert abs(got[0].item() - F.cross_entropy(h.detach() @ w.detach().T, y).item()) > 1e-6


def test_bf16_inputs_give_bf16_grads(gen):
    h, w, y = _inputs(gen, dtype=torch.bfloat16)
    loss = ChunkedLinearCrossEntropy.apply(h, w, y, 8)
    loss.backward()
    ref_loss, ref_h, ref_w = _reference64(h, w, y)
    assert loss.dtype == torch.float32
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16
    assert abs(loss.item() - ref_loss.item()) <= 1e-2 * ref_loss.item()
    assert _rel(h.grad, ref_h) < 2e-2 and _rel(w.grad, ref_w) < 2e-2


@pytest.mark.parametrize("frozen", ["hidden", "weight"])
def test_frozen_input_gets_no_grad(gen, frozen):
    h, w, y = _inputs(gen)
    (h if frozen == "hidden" else w).requires_grad_(False)
    ChunkedLinearCrossEntropy.apply(h, w, y, 8).backward()
    _, ref_h, ref_w = _reference64(h, w, y)
    if frozen == "hidden":
        assert h.grad is None and _rel(w.grad, ref_w) < 1e-6
    else:
        assert w.grad is None and _rel(h.grad, ref_h) < 1e-6


def _llama(tied: bool, seed: int = 0):
    torch.manual_seed(seed)
    return build_llama(CFG.model_copy(update={"tie_word_embeddings": tied}), vocab_size=VOCAB)


def _windows(b=2, length=12, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, length + 1), generator=gen)


def _loss_and_grads(model, fn):
    model.zero_grad(set_to_none=True)
    loss = fn()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
def test_causal_lm_loss_chunked_equals_causal_lm_loss(tied):
    model, windows = _llama(tied), _windows()
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    ref, ref_grads = _loss_and_grads(model, lambda: causal_lm_loss(model, windows))
    got, grads = _loss_and_grads(model, lambda: causal_lm_loss_chunked(model, windows, 5))
    assert got.dtype == torch.float32 and got.shape == ()
    assert abs(got.item() - ref.item()) < 1e-6
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    for name, g in grads.items():
        assert _rel(g, ref_grads[name]) < 1e-5, name


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(
    "device,batch,length,chunk", [("cpu", 2, 12, 7), pytest.param("cuda", 4, 64, 48, marks=CUDA)]
)
def test_causal_lm_loss_chunked_under_bf16_autocast(device, batch, length, chunk):
    """The trainer's setting: fp32 parameters, bf16 autocast (on a GPU: cuBLAS's bf16 GEMMs)."""
    model, windows = _llama(False).to(device), _windows(b=batch, length=length).to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        ref, ref_grads = _loss_and_grads(model, lambda: causal_lm_loss(model, windows))
        got, grads = _loss_and_grads(model, lambda: causal_lm_loss_chunked(model, windows, chunk))
    assert abs(got.item() - ref.item()) <= 1e-5 * ref.item()
    for name, g in grads.items():
        assert g.dtype == torch.float32
        assert _rel(g, ref_grads[name]) < 2e-2, name


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, None])
def test_bad_chunk_tokens(gen, bad):
    h, w, y = _inputs(gen)
    with pytest.raises(ValueError, match="chunk_tokens must be a positive int"):
        ChunkedLinearCrossEntropy.apply(h, w, y, bad)
    with pytest.raises(ValueError, match="chunk_tokens must be a positive int"):
        causal_lm_loss_chunked(_llama(False), _windows(), bad)


def test_wrapped_model_or_head_bias_refused():
    class Wrapper(nn.Module):  # DDP-like: the model sits under .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    model = _llama(False)
    with pytest.raises(ValueError, match=r"got Wrapper; pass the unwrapped model"):
        causal_lm_loss_chunked(Wrapper(model), _windows(), 8)
    model.lm_head = nn.Linear(CFG.hidden_size, VOCAB, bias=True)
    with pytest.raises(ValueError, match="bias-free lm_head"):
        causal_lm_loss_chunked(model, _windows(), 8)


def test_shape_mismatch_refused(gen):
    h, w, y = _inputs(gen)
    with pytest.raises(ValueError, match="labels"):
        ChunkedLinearCrossEntropy.apply(h, w, y[:-1], 8)
    with pytest.raises(ValueError, match="weight"):
        ChunkedLinearCrossEntropy.apply(h, w[:, :-1], y, 8)


def _saved_numels(fn) -> list[int]:
    """Element counts of every tensor saved for backward while ``fn()`` runs."""
    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


def test_logits_are_not_saved_for_backward(gen):
    h, w, y = _inputs(gen)
    saved = _saved_numels(lambda: ChunkedLinearCrossEntropy.apply(h, w, y, 8))
    assert sorted(saved) == sorted([N * D, V * D, N, N])  # hidden, weight, labels, lse

    model, windows = _llama(False), _windows()
    n_logits = windows[:, 1:].numel() * VOCAB  # 24 × 101, no other tensor of that size
    # the check can fail: the unchunked loss saves [N, V] tensors (bf16/fp32 logits, softmax)
    assert n_logits in _saved_numels(lambda: causal_lm_loss(model, windows))
    saved = _saved_numels(lambda: causal_lm_loss_chunked(model, windows, 5))
    assert n_logits not in saved
    assert max(saved) == VOCAB * CFG.hidden_size  # the largest is the lm_head/embedding weight


def test_training_losses_build_no_kv_cache(gen, monkeypatch):
    """Both losses run the decoder with ``use_cache=False``: no layer's keys/values are copied
    into a cache (a ``torch.cat`` per layer and tensor that nothing reads). The control call
    shows the spy sees the cache a default forward builds."""
    import transformers.cache_utils as cache_utils

    calls = {"n": 0}
    real = cache_utils.Cache.update

    def spy(self, *args, **kwargs):
        calls["n"] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cache_utils.Cache, "update", spy)
    model = build_llama(CFG, VOCAB)
    windows = torch.randint(0, VOCAB, (2, 9), generator=gen)
    model(input_ids=windows[:, :-1])  # control: transformers' default caches
    assert calls["n"] == CFG.num_hidden_layers
    calls["n"] = 0
    causal_lm_loss(model, windows).backward()
    causal_lm_loss_chunked(model, windows, 4).backward()
    assert calls["n"] == 0


class _Recorder:
    """A row update that records each slice and then changes the rows it was given (so a
    gradient computed from already-updated rows would show)."""

    def __init__(self, row_align: int) -> None:
        self.row_align = row_align
        self.slices: list[tuple[int, int, torch.Tensor]] = []

    def __call__(self, weight, start, end, grad):
        self.slices.append((start, end, grad.clone()))
        with torch.no_grad():
            weight[start:end] += 100.0


@pytest.mark.parametrize("frozen_hidden", [False, True])
def test_registered_row_update_gets_the_weight_gradient_in_complete_slices(
    gen, monkeypatch, frozen_hidden
):
    from poetxq.training import loss as loss_mod

    # 3 rows x 16 x 4 bytes per slice asked, aligned to 2 rows: slices of 2 rows, 25 of them
    monkeypatch.setattr(loss_mod, "SLICE_BYTES", 3 * D * 4)
    h, w, y = _inputs(gen)
    y[:4] = torch.tensor([0, V - 1, 1, 2])  # labels in the first, the last and a middle slice
    h.requires_grad_(not frozen_hidden)
    _, ref_h, ref_w = _reference64(h, w, y)
    rec = _Recorder(row_align=2)
    loss_mod.register_row_update(w, rec)
    try:
        (2.0 * ChunkedLinearCrossEntropy.apply(h, w, y, 8)).backward()
    finally:
        loss_mod.register_row_update(w, None)
    assert w.grad is None  # no [V, d] gradient: the update took it
    assert [(s, e) for s, e, _ in rec.slices] == [(i, min(i + 2, V)) for i in range(0, V, 2)]
    got = torch.cat([g for _, _, g in rec.slices])
    assert got.dtype == torch.float32 and _rel(got, 2.0 * ref_w) < 1e-6
    if frozen_hidden:
        assert h.grad is None
    else:  # from the rows before any update
        assert _rel(h.grad, 2.0 * ref_h) < 1e-6
    # unregistered: the whole gradient again
    w.grad = None
    ChunkedLinearCrossEntropy.apply(h, w.detach().requires_grad_(), y, 8).backward()
    assert len(rec.slices) == V // 2


def test_row_update_slices_bf16_weight_under_its_byte_budget(gen, monkeypatch):
    from poetxq.training import loss as loss_mod

    monkeypatch.setattr(loss_mod, "SLICE_BYTES", 8 * D * 2)  # 8 bf16 rows
    h, w, y = _inputs(gen, dtype=torch.bfloat16)
    _, _, ref_w = _reference64(h, w, y)
    rec = _Recorder(row_align=1)
    loss_mod.register_row_update(w, rec)
    try:
        ChunkedLinearCrossEntropy.apply(h, w, y, 4).backward()
    finally:
        loss_mod.register_row_update(w, None)
    assert [e - s for s, e, _ in rec.slices] == [8] * 6 + [2]
    got = torch.cat([g for _, _, g in rec.slices])
    assert got.dtype == torch.bfloat16 and _rel(got, ref_w) < 2e-2


@pytest.mark.parametrize("tied", [False, True])
def test_causal_lm_loss_chunked_slices_an_untied_head_only(tied):
    """A registered row update takes an untied head's gradient; a tied head (which also gets
    the embedding's gradient) keeps its whole .grad and the update is not called."""
    from poetxq.training import loss as loss_mod

    model, windows = _llama(tied), _windows()
    head = model.lm_head.weight
    _, ref_grads = _loss_and_grads(model, lambda: causal_lm_loss(model, windows))
    rec = _Recorder(row_align=1)
    loss_mod.register_row_update(head, rec)
    try:
        model.zero_grad(set_to_none=True)
        causal_lm_loss_chunked(model, windows, 5).backward()
    finally:
        loss_mod.register_row_update(head, None)
    if tied:  # named once, as the embeddings
        assert rec.slices == [] and _rel(head.grad, ref_grads["model.embed_tokens.weight"]) < 1e-5
    else:
        assert head.grad is None
        got = torch.cat([g for _, _, g in rec.slices])
        assert _rel(got, ref_grads["lm_head.weight"]) < 1e-5
