"""Multi-GPU (DDP) checks on one host with 2 GPUs; writes one JSON to ``--out``.

1. **Equivalence at a real width** (fp32, ``train.precision=fp32``): Llama-1B layer shapes
   (hidden 2048, intermediate 5632, 32 heads, vocab 32000; 2 layers to keep it short), seq 256.
   1 process with batch 8 against 2 processes with batch 4 each (the same global batch), for
   POET-XQ int8 (merges every 4 steps) and Q-APOLLO (int8 weights whose gradients are
   all-reduced outside DDP). Per-step losses must agree to ``--rtol``; the 2-process run must end
   with identical weights on both ranks (``replicas_identical``).
2. **Resume under DDP on the GPU**: the 2-process POET-XQ run is resumed from its step-5
   checkpoint; the resumed losses are compared with the uninterrupted ones (deterministic
   algorithms on; reported as bit-exact or with the largest difference).
3. **Throughput**, Llama-1B (24 layers, recipes/models/llama-1b.yaml), bf16 autocast, seq 256, 16
   sequences per GPU per step: tokens/s of POET-XQ int8 (b = 256, no merge inside the timed
   window) and AdamW at 1 and 2 GPUs, the steady-state median over logged windows after the first;
   the scaling ratio tok/s(2 GPUs) / tok/s(1 GPU) (ideal 2.0) and peak memory per GPU.
4. **Merge strategy**: time of the deterministic merge every rank runs (4 POET-XQ layers at the
   1B shapes) against broadcasting the merged int8 weights and permutations from rank 0, which a
   rank-0 merge would need.

Tokens are synthetic (no network, no tokenizer): each window repeats a random 64-token phrase,
so the loss falls as the model learns to copy. Every run goes through the real training loop
(:func:`poetxq.training.train.train`), launched with ``torchrun --standalone``.

Usage (on the 2-GPU host, repository root, PYTHONPATH=.):
    python evals/multi_gpu.py --out $OUT/multi_gpu_h200x2.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32,
            "num_hidden_layers": 24}  # fmt: skip
SIZES = {  # --smoke: the same script at toy size on CPU (gloo), to check it end to end
    "real": {"model": LLAMA_1B, "vocab": 32000, "seq_len": 256, "block": 256},
    "smoke": {"model": {"hidden_size": 64, "intermediate_size": 136, "num_attention_heads": 4,
                        "num_hidden_layers": 2}, "vocab": 512, "seq_len": 32, "block": 16},
}  # fmt: skip


# ------------------------------------------------------------------------------------------------
# worker: one training run inside torchrun (or a plain process)
# ------------------------------------------------------------------------------------------------


def synthetic_data(vocab: int, seq_len: int, n_train: int, n_val: int, seed: int):
    """A :class:`poetxq.data.TokenData` of windows that repeat a random 64-token phrase."""
    import torch

    from poetxq.data import TokenData

    gen = torch.Generator().manual_seed(seed)

    def windows(n: int) -> torch.Tensor:
        phrase = torch.randint(0, vocab, (n, 64), generator=gen)
        reps = (seq_len + 1 + 63) // 64
        return phrase.repeat(1, reps)[:, : seq_len + 1].contiguous()

    train, val = windows(n_train), windows(n_val)
    return TokenData(
        train=train, val=val, tokenizer=None, vocab_size=vocab,  # type: ignore[arg-type]
        train_tokens=train.numel(), val_tokens=val.numel(),
        source_description=f"synthetic: random 64-token phrases repeated (vocab {vocab})",
        eos_id=0,
    )  # fmt: skip


def merge_cost_worker(spec: dict) -> None:
    """Time one deterministic merge of every POET-XQ layer against broadcasting the merged state
    (int8 W0, SCB, permutations) from rank 0, at the given model shape (median of 3, ms)."""
    import torch
    import torch.distributed as dist

    from poetxq.model.surgery import build_llama, convert_to_poetx, poet_layers
    from poetxq.training.optim import build_optimizer, merge_and_reset
    from poetxq.training.recipe_files import load_recipe

    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    dev = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo")
    recipe = load_recipe(None, spec["overrides"])
    model = build_llama(recipe.model, spec["vocab"])
    convert_to_poetx(model, recipe.poet, generator=torch.Generator().manual_seed(1))
    model.to(dev)
    opt = build_optimizer(model, recipe.optim)
    layers = poet_layers(model)
    state = [b for layer in layers for b in layer.buffers()]

    def timed(fn) -> float:
        times = []
        for _ in range(3):
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    gen = torch.Generator().manual_seed(2)
    merge_ms = timed(lambda: merge_and_reset(model, opt, gen))

    def broadcast() -> None:
        for b in state:
            dist.broadcast(b, src=0)

    bcast_ms = timed(broadcast)
    if rank == 0:
        Path(spec["result"]).write_text(json.dumps({
            "layers": len(layers), "merge_ms": merge_ms, "broadcast_ms": bcast_ms,
            "broadcast_bytes": sum(b.numel() * b.element_size() for b in state),
        }))  # fmt: skip
    dist.destroy_process_group()


def worker(spec_path: str) -> None:
    """Run one training described by the JSON spec; rank 0 writes the result JSON."""
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("kind") == "merge_cost":
        merge_cost_worker(spec)
        return
    import torch

    if spec.get("deterministic"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    from poetxq.training.recipe_files import load_recipe
    from poetxq.training.train import train

    recipe = load_recipe(None, spec["overrides"])
    tc = recipe.train
    world = int(os.environ.get("WORLD_SIZE", "1"))
    n_train = max(tc.max_steps * tc.batch_size * tc.grad_accum * world, 64)
    data = synthetic_data(spec["vocab"], tc.seq_len, n_train, 16, seed=1234)
    rank = int(os.environ.get("RANK", "0"))
    resume = Path(spec["resume_from"]) if spec.get("resume_from") else None
    t0 = time.perf_counter()
    train(recipe, Path(spec["run_dir"]), progress=False, data=data,
                   echo=print if rank == 0 else (lambda _s: None), resume_from=resume)  # fmt: skip
    wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    Path(f"{spec['result']}.peak{rank}").write_text(json.dumps(peak))  # read by the driver
    if rank != 0:
        return
    records = [json.loads(x) for x in (Path(spec["run_dir"]) / "metrics.jsonl").read_text().split(
        "\n") if x.strip()]  # fmt: skip
    steps = [r for r in records if "lr" in r]
    windows = [r["tokens_per_s"] for r in steps][1:]  # first window holds warm-up/compilation
    out = {
        "losses": {str(r["step"]): r["loss"] for r in steps},
        "tokens_per_s_windows": [r["tokens_per_s"] for r in steps],
        "tokens_per_s_median": statistics.median(windows) if windows else None,
        "wall_s_including_setup": wall,
        "summary": json.loads((Path(spec["run_dir"]) / "summary.json").read_text()),
    }
    Path(spec["result"]).write_text(json.dumps(out))


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------


def _overrides(method: str, *, size: dict, model: dict, steps: int, batch: int, precision: str,
               log_every: int, merge_interval: int, save_every: int = 0,
               save: bool = False) -> dict:  # fmt: skip
    o = {f"model.{k}": v for k, v in model.items()}
    o.update({
        "method": method, "train.max_steps": steps, "train.batch_size": batch,
        "train.seq_len": size["seq_len"], "train.log_every": log_every, "train.eval_every": 10**6,
        "train.eval_max_batches": 1, "train.precision": precision,
        "train.save_checkpoint": save, "train.save_every": save_every, "train.keep_last": 2,
        "optim.warmup_steps": 2, "poet.block_size": size["block"],
        "poet.merge_interval": merge_interval, "optim.lr": 1e-3, "optim.poet_lr": 4e-3,
        "baseline.rank": min(128, size["model"]["hidden_size"] // 4),
        "baseline.update_proj_gap": 4,
    })  # fmt: skip
    if method in ("qgalore", "qapollo"):
        o["optim.grad_clip"] = 0.0
    return o


def method_spec(spec: str, extra: dict) -> tuple[str, dict]:
    """``"poetxq@step"`` -> ``("poetxq", {..extra, "train.grad_sync": "step"})``: a method name
    with an optional ``@ddp`` / ``@step`` gradient synchronisation (``train.grad_sync``)."""
    method, _, sync = spec.partition("@")
    if sync and sync not in ("ddp", "step"):
        raise SystemExit(f"multi_gpu.py: {spec!r}: the part after @ must be ddp or step")
    return method, {**extra, **({"train.grad_sync": sync} if sync else {})}


def launch(name: str, overrides: dict, nproc: int, work: Path, *, vocab: int,
           resume_from: str | None = None, run_dir: Path | None = None,
           deterministic: bool = False, timeout: float = 600,
           kind: str = "train") -> dict:  # fmt: skip
    """Run one worker with ``nproc`` processes; returns its result (or an ``error``)."""
    run_dir = run_dir or work / name
    spec = {"overrides": overrides, "run_dir": str(run_dir), "result": str(work / f"{name}.json"),
            "resume_from": resume_from, "deterministic": deterministic, "vocab": vocab,
            "kind": kind}  # fmt: skip
    spec_path = work / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    me = str(Path(__file__).resolve())
    cmd = [sys.executable, me, "--worker", str(spec_path)]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", me, "--worker", str(spec_path)]  # fmt: skip
    t0 = time.perf_counter()
    try:
        root = str(Path(__file__).resolve().parents[1])  # this checkout's poetxq first
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    res: dict = {"launch_s": time.perf_counter() - t0, "nproc": nproc}
    if proc.returncode != 0:
        res["error"] = proc.stderr[-4000:]
        return res
    res.update(json.loads((work / f"{name}.json").read_text()))
    if kind == "train":
        res["peak_mem_gib_per_rank"] = [
            json.loads(Path(f"{work / name}.json.peak{r}").read_text()) for r in range(nproc)
        ]
    print(f"[{name}] done in {res['launch_s']:.0f} s", flush=True)
    return res


def compare(a: dict, b: dict, rtol: float) -> dict:
    """Per-step loss agreement of two results."""
    if "error" in a or "error" in b:
        return {"ok": False, "reason": "a run failed"}
    steps = sorted(set(a["losses"]) & set(b["losses"]), key=int)
    rel = [abs(a["losses"][s] - b["losses"][s]) / abs(a["losses"][s]) for s in steps]
    return {
        "steps": len(steps), "max_rel_diff": max(rel), "rtol": rtol,
        "ok": max(rel) <= rtol and len(steps) == len(a["losses"]),
        "bit_exact": all(a["losses"][s] == b["losses"][s] for s in steps),
        "first_last_loss": [a["losses"][steps[0]], a["losses"][steps[-1]]],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="result JSON path (default $OUT/multi_gpu_h200x2.json)")
    ap.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    ap.add_argument("--budget-s", type=float, default=540, help="skip parts once this is spent")
    ap.add_argument("--rtol", type=float, default=1e-4, help="fp32 loss agreement, 1 vs 2 GPUs")
    ap.add_argument("--equiv-steps", type=int, default=10)
    ap.add_argument("--tput-steps", type=int, default=25)
    ap.add_argument("--smoke", action="store_true", help="toy sizes on CPU (checks the script)")
    ap.add_argument("--parts", default="equivalence,throughput,merge",
                    help="comma-separated subset of equivalence,throughput,merge")  # fmt: skip
    ap.add_argument("--tput-methods", default="poetxq,adamw",
                    help="methods timed at 1 and 2 GPUs; METHOD@step or METHOD@ddp also sets "
                    "train.grad_sync (e.g. poetxq@step,poetxq@ddp,adamw)")  # fmt: skip
    ap.add_argument("--equiv-methods", default="poetxq,qapollo",
                    help="methods whose 1- and 2-GPU losses are compared (METHOD@step allowed; "
                    "the first POET one is also resumed)")  # fmt: skip
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="recipe override for every run (repeatable)")  # fmt: skip
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if not parts <= {"equivalence", "throughput", "merge"}:
        ap.error(f"--parts: unknown {sorted(parts - {'equivalence', 'throughput', 'merge'})}")
    if args.worker:
        worker(args.worker)
        return
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import git_commit

    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "multi_gpu_h200x2.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    n_gpu = torch.cuda.device_count()
    size = SIZES["smoke" if args.smoke else "real"]
    n_dev = 2 if args.smoke else n_gpu  # smoke: 2 CPU processes over gloo
    report: dict = {
        "script": "evals/multi_gpu.py",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": os.environ.get("POETXQ_COMMIT") or git_commit(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(n_gpu)],
        "torch": torch.__version__,
        "size": size,
        "equivalence": {}, "resume": {}, "throughput": {}, "skipped": [],
    }  # fmt: skip

    def save() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2))
        os.replace(tmp, out)

    def left() -> float:
        return args.budget_s - (time.perf_counter() - start)

    if n_dev < 2:
        report["skipped"].append(f"only {n_gpu} GPU(s): 2-GPU parts skipped")
    work = Path(tempfile.mkdtemp(prefix="multi_gpu_"))
    small = {**size["model"], "num_hidden_layers": 2}
    v = size["vocab"]

    # 1 + 2: equivalence in fp32 at the 1B width, then resume under DDP
    from poetxq.training.recipe_files import parse_override

    sets = dict(parse_override(pair) for pair in args.set)
    report["overrides"] = sets
    resumed = False
    for spec in args.equiv_methods.split(",") if "equivalence" in parts else []:
        method, extra = method_spec(spec, sets)
        merge = 4 if method in ("poetxq", "poetx") else 10**6
        tag = spec.replace("@", "_")
        if n_dev < 2 or left() < 120:
            report["skipped"].append(f"equivalence {spec}")
            continue
        kw = {"model": small, "steps": args.equiv_steps, "precision": "fp32", "log_every": 1,
              "merge_interval": merge, "size": size}  # fmt: skip
        resume_this = method in ("poetxq", "poetx") and not resumed
        save_kw = {"save": True, "save_every": 5} if resume_this else {}
        cap = {"timeout": max(min(left() - 60, 200), 30)}  # a hung launch must not eat it all
        one = launch(f"eq_{tag}_1", {**_overrides(method, batch=8, **kw), **extra}, 1, work,
                     vocab=v, **cap)  # fmt: skip
        two = launch(f"eq_{tag}_2", {**_overrides(method, batch=4, **kw, **save_kw), **extra},
                     2, work, vocab=v, deterministic=True, **cap)  # fmt: skip
        cmp = compare(one, two, args.rtol)
        cmp["replicas_identical"] = two.get("summary", {}).get("replicas_identical")
        cmp["ok"] = bool(cmp["ok"] and cmp["replicas_identical"])
        cmp["runs"] = {"1gpu": one, "2gpu": two}
        report["equivalence"][spec] = cmp
        save()
        if resume_this and "error" not in two and left() > 90:
            resumed = True
            ckpt = work / f"eq_{tag}_2" / "checkpoints" / "step-00000005"
            again = launch(f"resume_{tag}_2",
                           {**_overrides(method, batch=4, **kw, **save_kw), **extra}, 2,
                           work, vocab=v, resume_from=str(ckpt),
                           run_dir=work / f"eq_{tag}_2", deterministic=True,
                           timeout=max(min(left() - 60, 200), 30))  # fmt: skip
            if "error" in again:
                report["resume"] = {"ok": False, "error": again["error"]}
            else:
                tail = {s: v for s, v in two["losses"].items() if int(s) > 5}
                got = {s: again["losses"][s] for s in tail}
                diffs = [abs(got[s] - tail[s]) for s in tail]
                report["resume"] = {
                    "method": spec, "resumed_at_step": 5, "steps_compared": len(tail),
                    "bit_exact": got == tail, "max_abs_diff": max(diffs),
                    "losses_uninterrupted": tail, "losses_resumed": got,
                }  # fmt: skip
            save()

    # 3: throughput at Llama-1B, bf16
    for spec in args.tput_methods.split(",") if "throughput" in parts else []:
        method, extra = method_spec(spec, sets)
        res = {}
        for nproc in (1, 2):
            if nproc > max(n_dev, 1) or left() < 100:
                report["skipped"].append(f"throughput {spec} x{nproc}")
                continue
            o = _overrides(method, size=size, model=size["model"], steps=args.tput_steps,
                           batch=16, precision="fp32" if args.smoke else "bf16", log_every=5,
                           merge_interval=10**6)  # fmt: skip
            r = launch(f"tput_{spec.replace('@', '_')}_{nproc}", {**o, **extra}, nproc, work,
                       vocab=v, timeout=max(left(), 60))  # fmt: skip
            res[f"{nproc}gpu"] = {k: v for k, v in r.items() if k != "losses"}
            report["throughput"][spec] = res
            save()
        t1 = res.get("1gpu", {}).get("tokens_per_s_median")
        t2 = res.get("2gpu", {}).get("tokens_per_s_median")
        if t1 and t2:
            res["scaling_2_over_1"] = t2 / t1
    a = report["throughput"].get("adamw", {})
    for spec in [s for s in report["throughput"] if s.split("@")[0] == "poetxq"]:
        p = report["throughput"][spec]
        for n in ("1gpu", "2gpu"):
            tp = p.get(n, {}).get("tokens_per_s_median")
            ta = a.get(n, {}).get("tokens_per_s_median")
            if tp and ta:
                report["throughput"][f"{spec}_over_adamw_{n}"] = tp / ta
    # 4: merge on every rank (what the loop does) vs rank-0 merge + broadcast, 4 layers at 1B
    if "merge" in parts and n_dev >= 2 and left() > 60:
        four = {**size["model"], "num_hidden_layers": 4}
        o = _overrides("poetxq", size=size, model=four, steps=1, batch=1, precision="fp32",
                       log_every=1, merge_interval=1)  # fmt: skip
        r = launch("merge_cost", o, 2, work, vocab=v, kind="merge_cost",
                   timeout=max(min(left() - 10, 200), 30))  # fmt: skip
        r["note"] = (
            "merge_ms: every rank merges all layers itself (no communication); "
            "broadcast_ms: the cost a rank-0 merge would add on top of its own merge"
        )
        report["merge_vs_broadcast"] = r
        save()
    else:
        report["skipped"].append("merge vs broadcast")
    report["total_s"] = time.perf_counter() - start
    save()
    print(json.dumps({k: report[k] for k in ("skipped", "total_s")}))
    eq = {m: (c.get("ok"), c.get("max_rel_diff")) for m, c in report["equivalence"].items()}
    print("equivalence:", eq, "resume:", {k: report["resume"].get(k) for k in ("bit_exact",
          "max_abs_diff")})  # fmt: skip
    tput = {
        m: {n: v.get("tokens_per_s_median") for n, v in r.items() if isinstance(v, dict)}
        for m, r in report["throughput"].items()
        if isinstance(r, dict)
    }
    print("throughput:", tput)


if __name__ == "__main__":
    main()
