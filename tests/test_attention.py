"""poetxq.model.attention: during a (simulated) CUDA graph capture, transformers' SDPA attention
keeps ``is_causal=True`` with no mask, as it does outside a capture, with the same output."""

import pytest
import torch
import torch.nn.functional as F

from poetxq.model.attention import causal_mask_skipped
from poetxq.model.surgery import build_llama
from poetxq.training.recipe_files import load_recipe

masking_utils = pytest.importorskip("transformers.masking_utils")


def _sdpa_calls(model, ids, monkeypatch):
    """(attn_mask is None, is_causal) of every SDPA call in one forward, and the logits."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append((attn_mask is None, bool(is_causal)))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", real)
    return calls, logits


@pytest.fixture
def model():
    recipe = load_recipe(
        None,
        {
            "model.hidden_size": 32,
            "model.intermediate_size": 64,
            "model.num_attention_heads": 4,
            "model.num_hidden_layers": 2,
            "poet.block_size": 16,
        },
    )
    torch.manual_seed(0)
    m = build_llama(recipe.model, 64)
    m.config._attn_implementation = "sdpa"
    return m.eval()


def test_capture_keeps_is_causal_and_the_values(model, monkeypatch):
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    eager_calls, eager = _sdpa_calls(model, ids, monkeypatch)
    assert eager_calls and all(c == (True, True) for c in eager_calls)  # no mask outside capture

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    masked_calls, masked = _sdpa_calls(model, ids, monkeypatch)
    # what transformers does while capturing: a materialized mask, is_causal False
    assert all(c == (False, False) for c in masked_calls)
    with causal_mask_skipped() as replaced:
        assert replaced
        calls, logits = _sdpa_calls(model, ids, monkeypatch)
    assert all(c == (True, True) for c in calls)
    torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(masked, eager, rtol=1e-5, atol=1e-5)
    # restored afterwards: the capture's mask again
    after, _ = _sdpa_calls(model, ids, monkeypatch)
    assert all(c == (False, False) for c in after)


def test_other_masks_go_to_transformers():
    """A padding mask, a cache offset or a sliding window keep transformers' own mask."""
    fns = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS
    base = dict(batch_size=1, q_length=4, kv_length=4, q_offset=0, kv_offset=0,
                mask_function=masking_utils.causal_mask_function, attention_mask=None,
                allow_is_causal_skip=True, device="cpu")  # fmt: skip
    padding = torch.tensor([[False, True, True, True]])
    with causal_mask_skipped():
        assert fns["sdpa"](**base) is None
        for over in ({"attention_mask": padding}, {"q_length": 1, "q_offset": 3},
                     {"allow_is_causal_skip": False}, {"local_size": 2}):  # fmt: skip
            mine = fns["sdpa"](**{**base, **over})
            assert mine is not None or over.get("q_length") == 1
        got = fns["sdpa"](**{**base, "attention_mask": padding})
    # restored exactly: no local override left behind, the packed-sequence check is back
    assert "sdpa" not in getattr(fns, "_local_mapping", {})
    assert masking_utils.find_packed_sequence_indices.__name__ == "find_packed_sequence_indices"
    want = fns["sdpa"](**{**base, "attention_mask": padding})
    assert torch.equal(got, want) and not want[0, 0, :, 0].any()  # the padded key is masked


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_real_capture_runs_sdpa_without_a_mask(model, monkeypatch):
    """Inside :class:`poetxq.training.cudagraph.GraphedMicroStep`'s real capture, every SDPA call
    gets ``attn_mask=None, is_causal=True`` (a transformers change that moves its mask logic would
    show here), and the replayed loss equals the eager one."""
    from poetxq.training.cudagraph import GraphedMicroStep
    from poetxq.training.evaluate import causal_lm_loss

    net = model.cuda().train()
    real = F.scaled_dot_product_attention
    captured = []

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        if torch.cuda.is_current_stream_capturing():
            captured.append((attn_mask is None, bool(is_causal)))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    gen = torch.Generator(device="cuda").manual_seed(2)
    batch = torch.randint(0, 64, (2, 13), device="cuda", generator=gen)
    params = [p for p in net.parameters() if p.requires_grad]
    step = GraphedMicroStep(lambda b: causal_lm_loss(net, b), batch, params)
    assert len(captured) == 2 and all(c == (True, True) for c in captured)  # one per layer
    other = torch.randint(0, 64, (2, 13), device="cuda", generator=gen)
    replayed = step(other).item()
    with torch.no_grad():
        eager = causal_lm_loss(net, other).item()
    assert replayed == pytest.approx(eager, rel=1e-5)
