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


def test_cpu_host_leaves_no_cached_cpu_answer_to_can_triton_run_here():
    """torch caches ``has_triton`` for the process; first asked inside the CPU view it is False,
    and on a GPU host every later torch.compile of CUDA code stopped with TritonMissing."""
    from torch.utils._triton import has_triton

    has_triton.cache_clear()
    outside = has_triton()  # this host's real answer
    has_triton.cache_clear()  # a fresh worker: the first question comes inside the CPU view
    with cpu_host():
        has_triton()
    assert has_triton() == outside
