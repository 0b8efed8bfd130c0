"""Causal attention without a materialized mask while a CUDA graph is captured.

transformers' SDPA attention normally passes ``attn_mask=None, is_causal=True`` to
``torch.nn.functional.scaled_dot_product_attention`` when nothing is padded and there is no cache
(``transformers.masking_utils._ignore_causal_mask_sdpa``). While a CUDA stream is capturing it
refuses that shortcut (it cannot read a padding mask's values then) and builds a boolean
``[B, 1, S, S]`` mask instead. The graph replays whatever the capture recorded, so every step of a
graphed run then computed attention with an explicit mask: no causal tile skipping, and cuDNN's
masked kernels. On the H200 the Llama-1B attention in a POET-XQ graph took 25.6 ms of GPU time
per step at seq 1024 against 12.1 ms in the eager AdamW step (``evals/results/profiles/
profile_1b_1024_*_5ee40a3.txt``), while SDPA alone at that shape costs the same eagerly
and in a graph (``evals/results/bench_attention_h200.json``). With the mask skipped during the
capture the graph's attention took 11.8 ms (``profile_1b_1024_poetxq_fast_graph_f0ed639.txt``).

Checks that read tensor values, which a capture forbids, answer "mask needed" then: whether the
position ids hold several packed sequences (``find_packed_sequence_indices``; this one decides
with transformers 5.24) and, in some versions (5.17 on the H200), whether the causal mask may be
dropped at all (``_ignore_causal_mask_sdpa``). Our training batches are whole windows of tokens
— no padding, no cache, and no position ids passed (the model builds ``0 … S−1`` itself) — so
during the capture :func:`causal_mask_skipped` answers as transformers does outside a capture
for such a batch: no packed sequences, and the SDPA mask function returns ``None`` where the mask
is the plain causal one (no attention mask, no cache offsets, queries as long as keys). Other
masks (padding, a cache, sliding windows) go to transformers' own function; **packed position
ids passed by the caller are not detected inside the block** (it is only for the trainer's and
the benchmarks' whole windows). After the block both functions are back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def _skippable(kwargs: dict[str, Any], causal_fn: Any) -> bool:
    """Whether the mask of this call is the plain causal one, which ``is_causal=True`` gives."""
    return (
        kwargs.get("allow_is_causal_skip", False) is True
        and kwargs.get("attention_mask") is None
        and kwargs.get("mask_function") is causal_fn
        and kwargs.get("local_size") is None
        and kwargs.get("q_offset") == 0
        and kwargs.get("kv_offset") == 0
        and isinstance(kwargs.get("q_length"), int)
        and kwargs.get("q_length") == kwargs.get("kv_length")
    )


@contextmanager
def causal_mask_skipped() -> Iterator[bool]:
    """Within the block, transformers sees no packed sequences in the position ids, and its
    ``"sdpa"`` mask function returns ``None`` (so SDPA runs with ``is_causal=True``) for a plain
    causal mask over unpadded windows without a cache, even while a CUDA graph is being
    captured; padding, cache and sliding-window masks are answered by the original function.
    Only for batches of whole windows with no caller-given position ids (what
    :mod:`poetxq.training.train` and :mod:`poetxq.tools.bench` capture): packed position ids are not
    detected inside the block.

    Yields:
        Whether the functions were replaced (``False`` when this transformers has no mask
        interface of that form; the block then runs unchanged).
    """
    try:
        from transformers import masking_utils
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function
    except ImportError:  # transformers without the mask interface: nothing to change
        yield False
        return
    original = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    local = getattr(ALL_MASK_ATTENTION_FUNCTIONS, "_local_mapping", {})
    had_local = "sdpa" in local  # restore exactly: a local override, or none at all
    find_packed = getattr(masking_utils, "find_packed_sequence_indices", None)

    def sdpa_mask(*args: Any, **kwargs: Any) -> Any:
        if not args and _skippable(kwargs, causal_mask_function):
            return None
        return original(*args, **kwargs)

    ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] = sdpa_mask
    if find_packed is not None:
        masking_utils.find_packed_sequence_indices = lambda *_a, **_k: None
    try:
        yield True
    finally:
        if had_local or "sdpa" not in local:
            ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] = original
        else:  # the key was global only: drop our local entry
            del local["sdpa"]
        if find_packed is not None:
            masking_utils.find_packed_sequence_indices = find_packed
