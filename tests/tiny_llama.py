"""Tiny random transformers Llamas for the tests of ``--model`` and FPO (one home for the
fixture code those test files shared)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(
    vocab_size: int = 61, hidden_size: int = 32, intermediate_size: int = 48, layers: int = 3
) -> LlamaForCausalLM:
    """A random ``LlamaForCausalLM`` (4 heads, 2 KV heads, 64 positions) in eval mode, drawn
    after ``torch.manual_seed(0)``."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def save_tiny_checkpoint(
    path: Path,
    *,
    hidden_size: int,
    intermediate_size: int,
    layers: int,
    text_stride: int,
    arch: str = "llama",
    texts: list[str] | None = None,
) -> Path:
    """A random Llama (or ``arch`` ``olmo2`` / ``gemma3``: the post-MLP-norm models FPO takes)
    and a 384-token byte-level BPE (trained on every ``text_stride``-th pydoc topic, ``</s>`` as
    EOS) saved side by side in ``path``, as ``save_pretrained`` writes them. ``texts``: train the
    tokenizer on these documents instead of the pydoc topics (the host Python's own, so they
    differ between Python releases)."""
    import pydoc_data.topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=["</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    topics = (texts if texts is not None else list(pydoc_data.topics.topics.values()))[
        ::text_stride
    ]
    tok.train_from_iterator(topics, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    torch.manual_seed(0)
    sizes = dict(
        vocab_size=len(hf_tok), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, eos_token_id=hf_tok.eos_token_id, bos_token_id=None,
        pad_token_id=None,
    )  # fmt: skip
    if arch == "olmo2":
        from transformers import Olmo2Config, Olmo2ForCausalLM

        model = Olmo2ForCausalLM(Olmo2Config(**sizes))
    elif arch == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        model = Gemma3ForCausalLM(Gemma3TextConfig(head_dim=hidden_size // 4, **sizes))
    else:
        model = LlamaForCausalLM(LlamaConfig(**sizes))
    model.save_pretrained(str(path))
    hf_tok.save_pretrained(str(path))
    return path
