"""Export interoperability on a device: do bitsandbytes and transformers read our exports right?

Two parts, no data or network needed:

* **layers** — POET-X(Q) layers with non-trivial ``R``, ``P`` are merged and stored under
  bitsandbytes' keys (:func:`poetxq.tools.export_weights.merged_linear_state_dict`); bitsandbytes on
  ``--device`` loads them (``Linear8bitLt.load_state_dict``; ``Params4bit.from_prequantized``) and
  its dequantized weight is compared with ours (max abs difference; 0 means byte-for-byte the same
  decoding), and its forward with ``x @ Wᵀ``. Shapes include rows that are not a multiple of the
  64-block (96, 160), which bitsandbytes 0.50.2's CPU kernel decodes wrongly.
* **model** — a small random POET-XQ Llama (int8 and NF4 W0, non-zero ``Q``) is written as a run
  directory, exported to ``hf-bf16`` / ``hf-bnb8`` / ``hf-bnb4`` and loaded with
  ``AutoModelForCausalLM.from_pretrained(out, device_map=device)``; relative logit difference to
  our model (fp32), to our model after the merge export does for the bnb format of the run's own
  store (one training merge; the export should match it within bf16), and to our own decoding of
  the exported bytes in a plain fp32 transformers model (isolating how bitsandbytes/transformers
  read the bytes from the rounding that export adds) is recorded.

    python evals/export_check.py --device cuda --out $OUT/export_check_h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import git_commit

from poetxq.model.layer import POETXLinear
from poetxq.model.surgery import build_llama, convert_to_poetx, poet_layers
from poetxq.tools.export import export_run, load_run
from poetxq.tools.export_weights import (
    decode_state_dict,
    merged_linear_state_dict,
    merged_state_dict,
)
from poetxq.training.recipe import dump_recipe
from poetxq.training.recipe_files import load_recipe
from poetxq.training.rundir import save_checkpoint, save_run_artifacts
from quant_kernels import reference_4bit as q4
from quant_kernels.reference import dequant_int8_rowwise
from quant_kernels.reference_double_quant import double_dequantize_absmax

SHAPES = [(96, 128), (64, 96), (704, 256), (256, 704), (48, 160)]


def _layer(n: int, m: int, bits: int, quant_type: str, seed: int) -> POETXLinear:
    g = torch.Generator().manual_seed(seed)
    layer = POETXLinear(n, m, block_size=16, bits=bits, quant_type=quant_type, generator=g)
    with torch.no_grad():
        layer.P.Q.normal_(0, 0.05, generator=g)
        layer.R.Q.normal_(0, 0.05, generator=g)
    return layer


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def check_layers(device: str) -> list[dict]:
    """bitsandbytes on ``device`` vs our decoding of the same exported bytes."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbF

    rows = []
    for m, n in SHAPES:
        x = torch.randn(7, n, generator=torch.Generator().manual_seed(1))
        layer = _layer(n, m, 8, "nf4", seed=m + n)
        sd = merged_linear_state_dict(layer, "hf-bnb8")
        ours = dequant_int8_rowwise(sd["weight"], sd["SCB"])
        lin = bnb.nn.Linear8bitLt(n, m, bias=False, has_fp16_weights=False).to(device)
        lin.load_state_dict({k: v.to(device) for k, v in sd.items()})
        theirs = bnbF.int8_vectorwise_dequant(lin.weight.data, lin.weight.SCB)
        out = {}
        for mode in ("eval", "train"):
            lin.train(mode == "train")
            with torch.no_grad():
                y = lin(x.to(device).half()).float()
            out[mode] = _rel(y, x @ ours.t())
        rows.append({"format": "int8", "shape": [m, n],
                     "dequant_max_abs_diff": (theirs.float().cpu() - ours).abs().max().item(),
                     "forward_rel_err_eval_fp16": out["eval"],
                     "forward_rel_err_train_fp16": out["train"]})  # fmt: skip
        for qt in ("nf4", "fp4"):
            layer = _layer(n, m, 4, qt, seed=m * n)
            sd = merged_linear_state_dict(layer, "hf-bnb4", quant_type=qt)
            meta = q4.quant_state_from_tensor(sd[f"weight.quant_state.bitsandbytes__{qt}"])
            absmax = double_dequantize_absmax(
                sd["weight.absmax"], sd["weight.nested_absmax"], sd["weight.nested_quant_map"],
                torch.tensor(meta["nested_offset"]), 256,
            )  # fmt: skip
            ours = q4.dequantize_4bit_blockwise(sd["weight"], absmax, qt, 64, (m, n))
            lin = bnb.nn.Linear4bit(n, m, bias=False, quant_type=qt, compute_dtype=torch.float32)
            stats = {
                k.removeprefix("weight."): v.to(device) for k, v in sd.items() if k != "weight"
            }
            lin.weight = bnb.nn.Params4bit.from_prequantized(
                sd["weight"].to(device), stats, device=device, module=lin
            )
            theirs = bnbF.dequantize_4bit(lin.weight.data, lin.weight.quant_state)
            lin.train()
            with torch.no_grad():
                y = lin(x.to(device))
            rows.append({"format": qt, "shape": [m, n],
                         "dequant_max_abs_diff": (theirs.float().cpu() - ours).abs().max().item(),
                         "forward_rel_err_fp32": _rel(y, x @ ours.t())})  # fmt: skip
    return rows


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["</s>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok, vocab["</s>"]


def check_model(device: str, bits: int, tmp: Path) -> dict:
    """Export a random POET model (``bits`` W0) three ways and load each with from_pretrained."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    recipe = load_recipe(None, {
        "poet.bits": bits, "poet.block_size": 32, "model.hidden_size": 128,
        "model.intermediate_size": 256, "model.num_hidden_layers": 2,
        "model.num_attention_heads": 4,
    })  # fmt: skip
    tok, eos = _byte_tokenizer()
    torch.manual_seed(0)
    model = build_llama(recipe.model, tok.get_vocab_size())
    g = torch.Generator().manual_seed(1)
    convert_to_poetx(model, recipe.poet, generator=g)
    with torch.no_grad():
        for layer in poet_layers(model):
            layer.P.Q.normal_(0, 0.03, generator=g)
            layer.R.Q.normal_(0, 0.03, generator=g)
    run = tmp / f"run{bits}"
    run.mkdir()
    (run / "recipe.yaml").write_text(dump_recipe(recipe))
    save_checkpoint(model, run / "model.safetensors")
    save_run_artifacts(run, model, tok, eos)
    ids = torch.tensor([list(b"The quick brown fox jumps over the lazy dog, twice over.")])
    model.eval()
    with torch.no_grad():
        ours = model(ids).logits
    result = {}
    for fmt in ("hf-bf16", "hf-bnb8", "hf-bnb4"):
        out = tmp / f"out{bits}-{fmt}"
        try:
            export_run(run, fmt, out, echo=lambda _s: None)
            loaded = AutoModelForCausalLM.from_pretrained(str(out), device_map=device).eval()
            plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
            plain.load_state_dict(decode_state_dict(load_file(str(out / "model.safetensors"))))
            twin = load_run(run, echo=lambda _s: None).model  # as export loads it
            merged_state_dict(twin, fmt, quant_type=recipe.poet.quant_type)  # export's merges
            with torch.no_grad():
                theirs = loaded(ids.to(device)).logits
                decoded = plain(ids).logits
                ours_merged = twin(ids).logits
            result[fmt] = {"rel_logit_diff_vs_ours": _rel(theirs, ours),
                           "rel_logit_diff_vs_ours_after_export_merge": _rel(theirs, ours_merged),
                           "rel_logit_diff_vs_our_decoding": _rel(theirs, decoded),
                           "layer_type": type(loaded.model.layers[0].mlp.down_proj).__name__,
                           "dtype": str(loaded.dtype)}  # fmt: skip
        except Exception as exc:  # record and go on
            result[fmt] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    import bitsandbytes
    import transformers

    report: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python evals/export_check.py " + " ".join(argv or sys.argv[1:]),
        "commit": git_commit(),
        "machine": f"{platform.machine()}, "
        + (torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "bitsandbytes": bitsandbytes.__version__,
        },
        "device": args.device,
    }
    try:
        report["layers"] = check_layers(args.device)
    except Exception as exc:
        report["layers_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    with tempfile.TemporaryDirectory() as tmp:
        report["model"] = {f"bits{b}": check_model(args.device, b, Path(tmp)) for b in (8, 4)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
