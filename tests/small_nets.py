"""A small MLP and its two AdamW param groups, shared by the optimizer-placement tests
(tests/test_lowmem.py: the optimizer in backward; tests/test_offload.py: host offload)."""

import torch
from torch import nn


def small_mlp() -> nn.Module:
    """64 -> 96 -> 8 with ReLU, seeded: its 64 x 96 = 6,144-element weight gets bitsandbytes'
    8-bit states (>= 4,096 elements), the other tensors fp32 ones."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 8))


def two_groups(m: nn.Module) -> list[dict]:
    """Weights (lr 1e-2, decay 0.1) and biases (lr 3e-3, no decay) of :func:`small_mlp`."""
    return [
        {"params": [m[0].weight, m[2].weight], "lr": 1e-2, "weight_decay": 0.1},
        {"params": [m[0].bias, m[2].bias], "lr": 3e-3, "weight_decay": 0.0},
    ]
