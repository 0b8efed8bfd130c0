import os

import torch

# Without a GPU, Triton kernels are tested through Triton's CPU interpreter; it must be chosen
# before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

# Keep CPU tests reproducible and light on the 2-core CI machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
