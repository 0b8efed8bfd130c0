"""tests/hosts.py: the CPU view of a GPU host holds for accelerate's per-process state too."""

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from hosts import cpu_host


def test_cpu_host_drops_the_gpu_device_an_earlier_run_left_in_accelerate():
    try:
        PartialState().device = torch.device("cuda", 0)  # as a GPU run earlier in the worker
        with cpu_host():
            assert not torch.cuda.is_available()
            assert Accelerator(cpu=True).device == torch.device("cpu")
        want = "cuda" if torch.cuda.is_available() else "cpu"
        assert PartialState().device.type == want  # found afresh after it
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
