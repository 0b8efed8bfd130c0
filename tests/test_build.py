"""Building the model a run trains (:mod:`poetxq.training.build`): the meta-init way that CUDA runs
take, forced on the CPU, against the classic way that CPU runs take."""

import json
import math
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from poetxq.model.config import ModelConfig, POETConfig
from poetxq.model.layer import POETXLinear
from poetxq.model.surgery import build_empty_llama, convert_to_poetx, materialize_meta_parameters
from poetxq.tools.bench import build_model_and_optimizer
from poetxq.training.build import META_INIT_ENV, build_for_training, use_meta_init
from poetxq.training.distributed import replicas_identical
from poetxq.training.evaluate import causal_lm_loss
from poetxq.training.recipe_files import load_recipe

V = 300
SMALL = {
    "model.hidden_size": 64, "model.intermediate_size": 136, "model.num_attention_heads": 4,
    "model.num_hidden_layers": 2, "poet.block_size": 16, "data.vocab_size": V,
    "baseline.rank": 8,
}  # fmt: skip
#: the methods' different builds: POET int8 / NF4 / unquantized, dense and int8 baselines
METHODS = {
    "poetxq": {}, "poetxq4": {"poet.bits": 4}, "poetx": {"method": "poetx"},
    "adamw": {"method": "adamw"}, "qgalore": {"method": "qgalore"},
}  # fmt: skip


#: one decoder layer, for the surgery-level tests
TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=1)


def _recipe(method: str = "poetxq", **overrides):
    return load_recipe(None, {**SMALL, **METHODS[method], **overrides})


def _build(recipe, meta: bool, seed: int = 0, vocab: int = V):
    torch.manual_seed(seed)  # the trainer's set_seed: the global (device) RNG
    gen = torch.Generator().manual_seed(recipe.train.seed + 1)
    return build_for_training(recipe, vocab, "cpu", generator=gen, meta_init=meta, echo=print)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return model.state_dict(keep_vars=True)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("method", list(METHODS))
def test_meta_init_builds_the_classic_model(method, tie):
    recipe = _recipe(method, **{"model.tie_word_embeddings": tie})
    classic, meta = _build(recipe, False), _build(recipe, True)
    assert meta.meta_init and not classic.meta_init and not meta.keep_weights
    a, m = classic.model, meta.model
    # nothing left on the meta device, and everything on the requested device
    tensors = [*m.parameters(), *m.buffers()]
    assert not any(t.is_meta for t in tensors) and {t.device.type for t in tensors} == {"cpu"}
    # same modules, same state (names, shapes, dtypes, trainability)
    assert [(n, type(x).__name__) for n, x in a.named_modules()] == [
        (n, type(x).__name__) for n, x in m.named_modules()
    ]
    sa, sm = _state(a), _state(m)
    assert list(sa) == list(sm)
    for k in sa:
        assert (sa[k].shape, sa[k].dtype, sa[k].requires_grad) == (
            sm[k].shape, sm[k].dtype, sm[k].requires_grad,
        ), k  # fmt: skip
    # POET: W0, permutations and Q come from the same generator as in the classic way
    for k in sa:
        if ".frozen." in k or k.endswith(("perm", ".Q", ".mask", "inv_freq")):
            assert torch.equal(sa[k], sm[k]), k
    assert torch.equal(m.model.rotary_emb.inv_freq, a.model.rotary_emb.inv_freq)
    # transformers' initialisation: N(0, initializer_range) embeddings / lm_head, norms = 1
    std = recipe.model.initializer_range
    emb, head = m.model.embed_tokens.weight, m.lm_head.weight
    assert (head is emb) == tie and (a.lm_head.weight is a.model.embed_tokens.weight) == tie
    for w in (emb, head):
        assert abs(w.std().item() - std) < 0.05 * std and abs(w.mean().item()) < 0.05 * std
    assert not torch.equal(emb, head) or tie
    norms = [p for n, p in m.named_parameters() if "norm" in n]
    assert len(norms) == 2 * recipe.model.num_hidden_layers + 1
    assert all(torch.equal(p, torch.ones_like(p)) for p in norms)
    if method in ("adamw", "qgalore"):  # the dense linears are trained: transformers' init too
        q = m.model.layers[0].self_attn.q_proj
        w = q.weight if method == "adamw" else q.dequantize()
        assert abs(w.float().std().item() - std) < 0.05 * std
        assert meta.baseline is not None and meta.baseline.targets == classic.baseline.targets
    else:
        assert meta.surgery is not None
        assert [c.name for c in meta.surgery.layers] == [c.name for c in classic.surgery.layers]
        assert not any(type(x) is nn.Linear for n, x in m.named_modules() if n != "lm_head")
    assert "meta init" in meta.build_line() and "meta init" not in classic.build_line()
    assert meta.summary(recipe).splitlines()[0] == classic.summary(recipe).splitlines()[0]


@pytest.mark.parametrize("method", ["poetxq", "poetxq4", "adamw", "qgalore"])
def test_meta_init_trains_from_the_initial_loss(method):
    """A bench-built model (``build_model_and_optimizer``, the trainer's builder) in the meta way:
    the loss at init is about ln(V), and a forward, backward and optimizer step work."""
    recipe = _recipe(method)
    torch.manual_seed(0)
    model, opt = build_model_and_optimizer(
        recipe, V, torch.device("cpu"), meta_init=True, echo=lambda _s: None
    )
    model.train()
    batch = torch.randint(0, V, (4, 17), generator=torch.Generator().manual_seed(5))
    loss = causal_lm_loss(model, batch)
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(V)) < 0.05
    loss.backward()
    emb = model.model.embed_tokens.weight
    assert emb.grad is not None and torch.isfinite(emb.grad).all() and emb.grad.abs().sum() > 0
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in trainable)
    before = emb.detach().clone()
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert not torch.equal(before, emb.detach())
    again = causal_lm_loss(model, batch)
    assert math.isfinite(again.item()) and again.item() < loss.item()


def test_meta_init_is_reproducible_and_seeded():
    """Two builds with the same seeds (two ranks) are equal bit for bit; another global seed
    changes the embeddings only (W0 and permutations come from the run's generator)."""
    recipe = _recipe("poetxq")
    one, two, other = _build(recipe, True), _build(recipe, True), _build(recipe, True, seed=7)
    s1, s2, s3 = _state(one.model), _state(two.model), _state(other.model)
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    changed = {k for k in s1 if not torch.equal(s1[k], s3[k])}
    assert changed == {"model.embed_tokens.weight", "lm_head.weight"}


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("method", ["poetxq", "adamw"])
def test_a_bf16_true_build_casts_as_it_goes_to_the_values_of_a_cast_afterwards(
    method, tie, monkeypatch
):
    """bf16-true in the meta way: each POET layer's Q and each materialized module's weights
    are cast as they are made (the float32 model never exists beside W0 on the device), to the
    same values as building in float32 and casting the whole model afterwards."""
    import poetxq.training.build as build

    over = {"model.tie_word_embeddings": tie}
    recipe = _recipe(method, **over, **{"train.precision": "bf16-true"})
    dtypes_at_materialize: list[set[torch.dtype]] = []
    real = build.materialize_meta_parameters

    def spy(model, device, **kwargs):
        if kwargs.get("within") is None:  # the whole-model call: the POET layers exist by now
            layers = [x for x in model.modules() if isinstance(x, POETXLinear)]
            dtypes_at_materialize.append({p.dtype for x in layers for p in x.parameters()})
        return real(model, device, **kwargs)

    monkeypatch.setattr(build, "materialize_meta_parameters", spy)
    cast = _build(recipe, True).model
    monkeypatch.undo()
    ref = _build(_recipe(method, **over), True).model  # float32, then cast below
    if method == "poetxq":
        assert dtypes_at_materialize == [{torch.bfloat16}]
    sc, sr = _state(cast), _state(ref)
    assert list(sc) == list(sr)
    for k in sc:
        want = sr[k].to(torch.bfloat16) if isinstance(sr[k], nn.Parameter) else sr[k]
        if sr[k].is_floating_point() and isinstance(sr[k], nn.Parameter):
            assert sc[k].dtype == torch.bfloat16, k
        assert torch.equal(sc[k], want), k
    assert (cast.lm_head.weight is cast.model.embed_tokens.weight) == tie


def _rank_worker(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    recipe = _recipe("poetxq")
    built = _build(recipe, True)  # every rank seeds as the trainer does and builds its own model
    same = replicas_identical(built.model)  # before DDP could broadcast anything
    differ = not replicas_identical(_build(recipe, True, seed=rank).model)
    torch.save({"same": same, "differ": differ}, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_build_identical_models(tmp_path):
    out = str(tmp_path / "res")
    mp.spawn(_rank_worker, args=(f"file://{tmp_path / 'store'}", out), nprocs=2)
    for rank in (0, 1):
        res = torch.load(f"{out}.{rank}", weights_only=True)
        assert res["same"] and res["differ"]


@pytest.mark.slow
def test_meta_init_is_faster_than_the_classic_build():
    """A mid-size model: the classic way initialises every dense linear before surgery throws it
    away; the meta way does not. Times are printed, not asserted (shared CI cores)."""
    recipe = load_recipe(None, {
        "model.hidden_size": 512, "model.intermediate_size": 1376,
        "model.num_attention_heads": 8, "model.num_hidden_layers": 6, "poet.block_size": 64,
    })  # fmt: skip
    times = {False: math.inf, True: math.inf}
    for _ in range(2):  # best of two, alternating (warm-up and shared cores)
        for meta in (True, False):
            start = time.perf_counter()
            built = _build(recipe, meta, vocab=8000)
            times[meta] = min(times[meta], time.perf_counter() - start)
            assert len(built.surgery.layers) == 7 * 6 and built.meta_init == meta
    print(f"\nbuild 512x6 (vocab 8000) on the CPU, best of 2: classic {times[False]:.2f} s, "
          f"meta init {times[True]:.2f} s (both draw W0 on the CPU in float64)")  # fmt: skip


def test_convert_needs_a_device_for_meta_linears():
    model = build_empty_llama(TINY, 50)
    cfg = POETConfig(block_size=16)
    with pytest.raises(ValueError, match="meta device"):
        convert_to_poetx(model, cfg)
    with pytest.raises(ValueError, match="meta device"):
        convert_to_poetx(model, cfg, keep_weights=True, device="cpu")
    report = convert_to_poetx(model, cfg, device="cpu", generator=torch.Generator().manual_seed(0))
    layers = [x for x in model.modules() if isinstance(x, POETXLinear)]
    assert len(layers) == len(report.layers) == 7
    assert all(not t.is_meta for x in layers for t in [*x.parameters(), *x.buffers()])
    assert model.model.embed_tokens.weight.is_meta  # the rest waits for materialization
    names = materialize_meta_parameters(model, "cpu")
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
    assert not any(p.is_meta for p in model.parameters())


def test_materialize_refuses_modules_it_cannot_initialise():
    model = build_empty_llama(TINY, 50)
    with torch.device("meta"):
        model.model.extra = nn.Conv1d(2, 2, 1)
    with pytest.raises(ValueError, match=r"model\.extra \(Conv1d\)"):
        materialize_meta_parameters(model, "cpu")


def test_meta_init_choice(monkeypatch):
    recipe, pre = _recipe(), _recipe(**{"model.pretrained": "/nonexistent"})
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv(META_INIT_ENV, raising=False)
    assert use_meta_init(recipe, cuda) and not use_meta_init(recipe, cpu)
    assert not use_meta_init(pre, cuda)  # a checkpoint is loaded with its weights
    monkeypatch.setenv(META_INIT_ENV, "0")
    assert not use_meta_init(recipe, cuda)
    monkeypatch.setenv(META_INIT_ENV, "1")
    assert use_meta_init(recipe, cpu) and not use_meta_init(pre, cpu)
    monkeypatch.setenv(META_INIT_ENV, "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        use_meta_init(recipe, cpu)
    with pytest.raises(ValueError, match="from scratch"):
        build_for_training(pre, V, "cpu", generator=torch.Generator(), meta_init=True)


@pytest.mark.slow
def test_trainer_builds_with_meta_init(tmp_path, tmp_path_factory, monkeypatch, capsys, cpu_only):
    """The trainer's CUDA way, taken on the CPU (``POETXQ_META_INIT=1``): it trains, says how the
    model was built, and the run is a normal run (the classic way, the same run otherwise)."""
    from poetxq.tools.cli import main

    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path_factory.getbasetemp() / "data-cache"))
    args = [
        "quantize-and-train", "--data", "pydoc", "--vocab-size", "512", "--seq-len", "32",
        "--batch-size", "8", "--block-size", "16", "--no-progress", "--max-steps", "10",
        "--merge-interval", "4", "--eval-every", "100", "--output-dir", str(tmp_path),
        "--set", "model.hidden_size=64", "--set", "model.intermediate_size=136",
        "--set", "model.num_attention_heads=4", "--set", "model.num_hidden_layers=2",
        "--set", "train.log_every=5", "--set", "optim.warmup_steps=3",
    ]  # fmt: skip
    summaries = {}
    for flag in ("1", "0"):
        monkeypatch.setenv(META_INIT_ENV, flag)
        assert main([*args, "--run-name", f"meta{flag}"]) == 0
        out = capsys.readouterr().out
        built = [line for line in out.splitlines() if line.startswith("model: built in ")]
        assert len(built) == 1 and built[0].endswith(
            "s on cpu (meta init: no CPU weights, W0 drawn and quantized on the device)"
            if flag == "1" else "s on cpu"
        )  # fmt: skip
        summaries[flag] = json.loads((tmp_path / f"meta{flag}" / "summary.json").read_text())
    meta, classic = summaries["1"], summaries["0"]
    assert meta["merges"] == classic["merges"] == 2 and meta["steps"] == 10
    # at init both are at about ln(V) (perplexity ~ V); after 10 steps both have learned
    assert abs(meta["initial_val_ppl"] / classic["initial_val_ppl"] - 1) < 0.05
    assert meta["final_val_ppl"] < 0.8 * meta["initial_val_ppl"]
    assert meta["final_val_ppl"] < 1.25 * classic["final_val_ppl"]
    assert meta["peak_memory_bytes"] is None


def test_quantized_baseline_is_materialized_one_layer_at_a_time(monkeypatch):
    """qgalore in the meta way: when a decoder layer is quantized, the dense fp32 linears that
    exist are that layer's only (the earlier ones are int8, the later ones not allocated)."""
    import poetxq.training.build as build

    recipe = _recipe("qgalore", **{"model.num_hidden_layers": 3})
    seen, model_ref = [], {}
    real = build.prepare_baseline

    def spy(module, method, cfg):
        assert module in list(model_ref["root"].model.layers)
        dense = [n for n, x in model_ref["root"].named_modules()
                 if type(x) is nn.Linear and not x.weight.is_meta]  # fmt: skip
        seen.append(dense)
        return real(module, method, cfg)

    real_empty = build.build_empty_llama

    def empty(cfg, vocab):
        model_ref["root"] = real_empty(cfg, vocab)
        return model_ref["root"]

    monkeypatch.setattr(build, "prepare_baseline", spy)
    monkeypatch.setattr(build, "build_empty_llama", empty)
    built = _build(recipe, True)
    assert len(seen) == 3
    for i, dense in enumerate(seen):
        assert len(dense) == 7 and all(n.startswith(f"model.layers.{i}.") for n in dense)
    assert len(built.baseline.targets) == 21 and built.baseline.weight_group_size == 256


def test_convert_with_an_explicit_device_keeps_the_weights_as_before():
    """The --model way on a GPU passes ``device=``; on the CPU that is the default, bit for bit."""
    from poetxq.model.surgery import build_llama

    torch.manual_seed(0)
    ref = build_llama(TINY, 50)
    other = build_llama(TINY, 50)
    other.load_state_dict(ref.state_dict())
    cfg = POETConfig(block_size=16, bits=4)
    convert_to_poetx(ref, cfg, keep_weights=True, generator=torch.Generator().manual_seed(3))
    convert_to_poetx(other, cfg, keep_weights=True, generator=torch.Generator().manual_seed(3),
                     device="cpu")  # fmt: skip
    sr, so = ref.state_dict(), other.state_dict()
    assert list(sr) == list(so) and all(torch.equal(sr[k], so[k]) for k in sr)
