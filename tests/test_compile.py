"""A whole POET-XQ model under ``torch.compile(fullgraph=True)``: one graph, no break, the same loss
and gradients as eager (issue 33 item 3: "a user can put a POET-XQ model under torch.compile").

``aot_eager`` traces forward and backward through dynamo and AOTAutograd exactly as inductor would,
without needing a C++ compiler on the test machine; inductor's code generation is the GPU suite's.
"""

from __future__ import annotations

import pytest
import torch

from poetxq.training.build import build_for_training
from poetxq.training.recipe_files import load_recipe

_TINY = {"model.num_hidden_layers": 1, "model.hidden_size": 64, "model.intermediate_size": 128,
         "model.num_attention_heads": 4, "poet.block_size": 16}  # fmt: skip


@pytest.mark.parametrize("bits", [8, 4, 16])
def test_a_poet_model_compiles_to_one_graph_with_eager_loss_and_gradients(bits):
    recipe = load_recipe("recipes/tiny/poetxq.yaml", {**_TINY, "poet.bits": bits})
    gen = torch.Generator().manual_seed(1)
    model = build_for_training(recipe, 512, torch.device("cpu"), generator=gen).model
    with torch.no_grad():  # rotations away from the identity, so every gradient is non-trivial
        for name, p in model.named_parameters():
            if name.endswith(".Q"):
                p.normal_(0, 0.05, generator=gen)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))

    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got = compiled(input_ids=ids, labels=ids).loss
    got.backward()
    torch._dynamo.reset()
    torch.testing.assert_close(got, loss, rtol=1e-6, atol=1e-6)
    assert {n for n, p in model.named_parameters() if p.grad is not None} == set(want)
    assert any(n.endswith(".Q") for n in want)
    for name, p in model.named_parameters():
        if name in want:
            torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-6, msg=name)
