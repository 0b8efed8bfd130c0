"""POET-X(Q) layers capture into a CUDA graph and replay to the eager values (GPU only).

Capture refuses host-to-device copies and host synchronisation, so this catches any per-call
``torch.tensor(...)`` or ``.item()`` that creeps into a layer's forward or backward (the 4-bit
code table and double-quant offset once did both).
"""

import pytest
import torch

from poetxq.model.layer import POETXLinear

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.mark.parametrize("bits", [8, 4, 16])
def test_layer_forward_backward_replays_from_a_cuda_graph(bits):
    gen = torch.Generator().manual_seed(0)
    layer = POETXLinear(256, 384, block_size=64, bits=bits, variant="mem", generator=gen,
                        device="cuda", dtype=torch.bfloat16)  # fmt: skip
    with torch.no_grad():
        for side in (layer.P, layer.R):
            side.Q.copy_(0.05 * torch.randn(side.Q.shape, generator=gen).to("cuda"))
    x = torch.randn(2, 96, 256, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    dy = torch.randn(2, 96, 384, generator=gen).to("cuda", torch.bfloat16)

    def step() -> torch.Tensor:
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        y = layer(x)
        y.backward(dy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            y_eager = step().detach().clone()
    torch.cuda.current_stream().wait_stream(side)
    dx_eager, dq_eager = x.grad.clone(), layer.P.Q.grad.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = step()
    x.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y_static, y_eager)
    torch.testing.assert_close(x.grad, dx_eager)
    torch.testing.assert_close(layer.P.Q.grad, dq_eager)
