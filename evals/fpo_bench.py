"""FPO vs SFT-partial vs full fine-tuning: tokens/s and peak memory at a fixed batch (issue 29).

A random Llama (1B-class by default: d 2048, 16 layers, MLP 5632, vocabulary 32,000; random weights
are fine for speed and memory) in bf16 with fp32 masters of what is trained. The MLPs of
``--targets`` adjacent layers are adapted, the last ones unless ``--below-top N`` leaves N layers
above them (which SFT-partial back-propagates through and FPO does not); at ``--bits 8|4`` every
other decoder linear is frozen in our int8 / NF4 stores
(:func:`poetxq.adapt.lowbit.freeze_low_bit`). ``full`` runs at 16 bits only (full fine-tuning of a
frozen low-bit base is not defined); ``full-ckpt`` is full fine-tuning with every decoder layer's
activations recomputed in backward (transformers' gradient checkpointing), the usual way to fit
full fine-tuning of a large model, which trades a fourth forward for memory. The paper's bar
(arXiv 2608.14563): FPO ≥ 2.7× the tokens/s of full fine-tuning, ~40 % less peak memory at a
fixed batch, 2.2× SFT-partial.

    python evals/fpo_bench.py --out $OUT/fpo_bench_h100.json
    python evals/fpo_bench.py --below-top 8 --methods fpo,sft-partial --bits 16 --out $OUT/x.json
    python evals/fpo_bench.py --methods fpo,full,full-ckpt --bits 16 --out $OUT/y.json
    python evals/fpo_bench.py --tiny --device cpu --out /tmp/fpo_bench_cpu.json   # smoke test
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from _common import provenance, write_json_atomic
from transformers import LlamaConfig, LlamaForCausalLM

from poetxq.adapt.fpo import FPOAdapter
from poetxq.adapt.lowbit import freeze_low_bit
from poetxq.adapt.reference import AutogradAdapter


def _model(args: argparse.Namespace, device: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.inter,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, max_position_embeddings=max(args.seq, 128),
        attn_implementation="sdpa",
    )  # fmt: skip
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def target_layers(n_layers: int, targets: int, below_top: int = 0) -> list[int]:
    """The ``targets`` adjacent layers that end ``below_top`` layers under the top of a stack of
    ``n_layers`` (``below_top`` 0: the last ones).

    Raises:
        SystemExit: the range does not fit in the stack.
    """
    first = n_layers - below_top - targets
    if targets < 1 or below_top < 0 or first < 0:
        raise SystemExit(f"error: --targets {targets} --below-top {below_top} do not fit in "
                         f"{n_layers} layers")  # fmt: skip
    return list(range(first, first + targets))


def gemm_macs(
    hidden: int,
    inter: int,
    layers: int,
    vocab: int,
    seq: int,
    targets: int,
    below_top: int = 0,
    *,
    causal_skip: bool = True,
) -> dict[str, int]:
    """Multiply-accumulates of matrix products per token of one step of each method, on a Llama
    of these sizes (no GQA): the work a GPU cannot skip, and so a bound on tokens/s ratios.

    A layer's forward: ``4·d²`` (q, k, v, o), ``3·d·f`` (the MLP), and the attention scores and
    mix, ``2·d·S`` per token for the full ``S × S`` products (``causal_skip``: half, as flash
    kernels skip the masked blocks). The head: ``d·V``. Full fine-tuning: three times the forward
    (input and weight gradients of every product; the scores' backward is twice their forward).
    FPO: the forward, the head twice (logits ``z`` and ``g = e·W_lm``) and ``4·d·f`` per target
    (``ΔW3``, ``error_h = g̃·W3``, ``ΔW1``, ``ΔW2``). SFT-partial: the forward, the head's input
    gradient, every layer above the lowest target back-propagated (attention's input gradient;
    a target MLP's input and weight gradients, a frozen one's input gradient) and the lowest
    target's MLP (its three weight gradients and the input gradient through ``W3``). Full
    fine-tuning with gradient checkpointing: full fine-tuning plus every decoder layer's forward
    once more but its last product, the down projection (torch's non-reentrant checkpoint stops
    recomputing once the tensors backward needs are back; the head is not recomputed).
    Embeddings, norms, softmax and the optimizer are not products and are left out.

    Returns:
        ``{"full", "full-ckpt", "fpo", "sft-partial"}``: MACs per token.
    """
    d, f, v = hidden, inter, vocab
    proj, mlp = 4 * d * d, 3 * d * f
    scores = d * seq if causal_skip else 2 * d * seq
    stack = layers * (proj + mlp + scores)
    forward = stack + d * v
    first = target_layers(layers, targets, below_top)[0]
    above = range(first + 1, layers)
    sft = forward + d * v + (mlp + d * f)
    sft += sum(proj + 2 * scores + (2 * mlp if i < first + targets else mlp) for i in above)
    return {
        "full": 3 * forward,
        "full-ckpt": 3 * forward + stack - layers * d * f,
        "fpo": forward + d * v + targets * 4 * d * f,
        "sft-partial": sft,
    }


METHODS = ("fpo", "sft-partial", "full", "full-ckpt")
REFERENCES = ("full", "full-ckpt")  # the rows others are compared with (16 bits only)


def make_adapter(
    model: LlamaForCausalLM, method: str, targets: list[int]
) -> FPOAdapter | AutogradAdapter:
    """The adapter of ``method`` (one of :data:`METHODS`) over ``targets``' MLPs, AdamW at lr
    1e-5; ``full-ckpt`` also turns on the model's gradient checkpointing (non-reentrant) and
    training mode, so each decoder layer's forward runs again in backward."""
    settings = dict(lr=1e-5, optimizer="adamw")
    if method == "fpo":
        return FPOAdapter(model, targets, **settings)
    if method == "full-ckpt":
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # the name from transformers 5.x on
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.train()
    mode = "partial" if method == "sft-partial" else "full"
    return AutogradAdapter(model, targets, mode=mode, **settings)


def _one(args: argparse.Namespace, method: str, bits: int, device: str) -> dict:
    model = _model(args, device)
    targets = target_layers(args.layers, args.targets, args.below_top)
    if bits < 16:
        freeze_low_bit(model, targets, bits)
    adapter = make_adapter(model, method, targets)
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
    ids, labels = batch[:, :-1], batch[:, 1:]
    cuda = device == "cuda"
    for _ in range(args.warmup):
        adapter.step(ids, labels)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        adapter.step(ids, labels)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    row = {
        "method": method, "bits": bits, "adapted_params": adapter.target_numel(),
        "tokens_per_s": args.steps * ids.numel() / elapsed, "step_s": elapsed / args.steps,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }  # fmt: skip
    del adapter, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--inter", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--targets", type=int, default=4, help="adapted layers (adjacent; the last ones "
                   "unless --below-top)")  # fmt: skip
    p.add_argument("--below-top", type=int, default=0, help="layers left above the targets: "
                   "SFT-partial back-propagates through them, FPO does not")  # fmt: skip
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bits", default="16,8,4", help="comma-separated, of 16, 8, 4 (the "
                   "full fine-tuning references run at 16 only)")  # fmt: skip
    p.add_argument("--methods", default="fpo,sft-partial,full,full-ckpt",
                   help=f"comma-separated, of {', '.join(METHODS)}")  # fmt: skip
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")  # fmt: skip
    p.add_argument("--tiny", action="store_true", help="a 4-layer d=64 model (smoke test)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.tiny:
        args.hidden, args.layers, args.inter, args.heads, args.vocab = 64, 4, 128, 4, 256
        args.batch, args.seq, args.targets, args.steps, args.warmup = 2, 32, 1, 2, 1
        args.below_top = min(args.below_top, 3)
    target_layers(args.layers, args.targets, args.below_top)  # a clear error before any work
    methods = list(dict.fromkeys(m.strip() for m in args.methods.split(",") if m.strip()))
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        p.error(f"--methods: unknown {', '.join(unknown) or '(none given)'}; choose from "
                f"{', '.join(METHODS)}")  # fmt: skip
    try:
        bits_list = list(dict.fromkeys(int(b) for b in args.bits.split(",") if b.strip()))
    except ValueError:
        bits_list = []
    if not bits_list or not set(bits_list) <= {16, 8, 4}:
        p.error(f"--bits {args.bits!r}: give a comma-separated list of 16, 8, 4")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; pass --device cpu")
    skipped = [m for m in methods if m in REFERENCES] if 16 not in bits_list else []
    if skipped:
        print(f"note: {', '.join(skipped)} run at --bits 16 only (full fine-tuning of a frozen "
              "low-bit base is not defined): skipped", flush=True)  # fmt: skip
    rows = []
    for bits in bits_list:
        for method in methods:
            if method in REFERENCES and bits < 16:
                continue
            rows.append(_one(args, method, bits, args.device))
            print(rows[-1], flush=True)
    for ref in REFERENCES:
        base = next((r for r in rows if r["method"] == ref), None)
        if base is None:
            continue
        key = ref.replace("-", "_")
        for r in rows:
            r[f"speed_vs_{key}"] = r["tokens_per_s"] / base["tokens_per_s"]
            if r["peak_memory_bytes"] and base["peak_memory_bytes"]:
                r[f"memory_vs_{key}"] = r["peak_memory_bytes"] / base["peak_memory_bytes"]
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    macs = gemm_macs(args.hidden, args.inter, args.layers, args.vocab, args.seq, args.targets,
                     args.below_top)  # fmt: skip
    bound = {
        "what": "matrix-product MACs per token of each method (gemm_macs: causal attention "
        "at half its S x S work) and full fine-tuning's over each: the tokens/s ratio if every "
        "method ran its products at one speed and did nothing else",
        "macs_per_token": macs,
        "full_over": {m: macs["full"] / n for m, n in macs.items()},
        "full_ckpt_over": {m: macs["full-ckpt"] / n for m, n in macs.items()},
    }
    print(f"GEMM bound: FPO {bound['full_over']['fpo']:.2f}x full fine-tuning "
          f"({bound['full_ckpt_over']['fpo']:.2f}x with checkpointing), SFT-partial "
          f"{bound['full_over']['sft-partial']:.2f}x, FPO / SFT-partial "
          f"{macs['sft-partial'] / macs['fpo']:.2f}x")  # fmt: skip
    doc = {**provenance(name, argv), "settings": {k: v for k, v in vars(args).items()},
           "gemm_bound": bound, "rows": rows}  # fmt: skip
    write_json_atomic(args.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
