import os

import pytest
import torch

# Keep CPU tests reproducible and light on the 2-core CI machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
