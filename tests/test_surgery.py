"""Model surgery on a real transformers Llama."""

import torch
from torch import nn

from poetxq.model.config import ModelConfig, POETConfig
from poetxq.model.layer import POETXLinear
from poetxq.model.orthogonal import packed_size
from poetxq.model.surgery import build_llama, convert_to_poetx, poet_layers, summarize

CFG = ModelConfig(hidden_size=48, intermediate_size=100, num_attention_heads=4,
                  num_hidden_layers=2, max_position_embeddings=64)  # fmt: skip


def test_all_projections_converted_including_ragged(gen):
    model = build_llama(CFG, vocab_size=97)
    report = convert_to_poetx(model, POETConfig(block_size=16, bits=8), generator=gen)
    assert len(report.layers) == 14
    assert not any(
        isinstance(m, nn.Linear) and not name.endswith("lm_head")
        for name, m in model.named_modules()
    )
    # 48 = 3x16 exact; 100 = 6x16 + 4 -> ragged last block of 4 on the MLP side
    ragged = {c.name.rsplit(".", 1)[-1] for c in report.ragged()}
    assert ragged == {"gate_proj", "up_proj", "down_proj"}
    gate = model.model.layers[0].mlp.gate_proj
    assert isinstance(gate, POETXLinear) and gate.R.ragged and gate.R.nb == 7
    text = summarize(model, report)
    # trainable Q count by formula: per side nb*b(b-1)/2, minus masked entries of ragged blocks
    full = packed_size(16)
    side48 = 3 * full
    side100 = 6 * full + 4 * 3 // 2
    per_layer = 4 * (2 * side48) + 2 * (side48 + side100) + (side100 + side48)
    assert f"{2 * per_layer:,} orthogonal" in text
    assert "14 linear layers converted" in text and "ragged" in text


def test_surgery_preserves_llama_function_at_identity(gen):
    """At Q = 0 the POET model equals the Llama whose linears hold the (dequantized) W0."""
    torch.manual_seed(0)
    model = build_llama(CFG, vocab_size=97)
    convert_to_poetx(model, POETConfig(block_size=16, bits=8), generator=gen)
    torch.manual_seed(0)
    dense = build_llama(CFG, vocab_size=97)
    dense.load_state_dict(
        {k: v for k, v in model.state_dict().items() if k in dense.state_dict()}, strict=False
    )
    for name, layer in model.named_modules():
        if isinstance(layer, POETXLinear):
            dense.get_submodule(name).weight.data.copy_(layer.effective_weight())
    ids = torch.randint(0, 97, (2, 12), generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense(ids).logits, rtol=1e-4, atol=1e-4)


def test_freeze_orthogonal(gen):
    model = build_llama(CFG, vocab_size=97)
    convert_to_poetx(model, POETConfig(block_size=16, freeze_orthogonal=True), generator=gen)
    assert all(not p.requires_grad for l_ in poet_layers(model) for p in l_.orthogonal_parameters())
    assert model.model.embed_tokens.weight.requires_grad
