"""The int8 MMA kernels compile for the GPUs they are meant for, without one: for sm90 (H100 /
H200) both GEMMs run on int8 warpgroup MMAs (``wgmma … s32.s8.s8``) fed by pipelined async
copies, for sm80 on int8 ``mma.sync``; the quantizer compiles in both roundings. Compiling takes
seconds per kernel on 2 cores, hence ``slow``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.slow

HELPER = Path(__file__).with_name("_int8_mma_codegen.py")
REPO = Path(__file__).resolve().parents[2]


def _codegen(cap: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(HELPER), str(cap)], capture_output=True, text=True,
                         env=env, timeout=600, check=False)  # fmt: skip
    if run.returncode and "ptxas" in run.stderr and "not found" in run.stderr:
        pytest.skip("Triton's bundled ptxas is missing")
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_hopper_gemms_use_int8_wgmma_with_pipelined_loads():
    res = _codegen(90)
    for gemm in ("forward", "dx"):
        ops = res[gemm]
        assert any(o.startswith("wgmma.mma_async") and o.endswith(".s32.s8.s8") for o in ops), ops
        assert "cp.async.commit_group" in ops, ops  # the K loop is software-pipelined
    assert res["quantize"] == "compiled"


def test_ampere_gemms_use_int8_mma_sync():
    res = _codegen(80)
    for gemm in ("forward", "dx"):
        assert any(o.startswith("mma.sync") and ".s32.s8.s8.s32" in o for o in res[gemm]), res
