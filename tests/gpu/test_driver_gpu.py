"""CUDA's driver and primary context started on a thread beside torch's import (engine/driver.py): torch then
runs in that same context, in a fresh process."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = """
import ctypes
from lmbatch.engine.driver import start_early
started = start_early("cuda")
import torch
started()
x = torch.arange(4.0, device="cuda").sum().item()
lib = ctypes.CDLL("libcuda.so.1")
primary, current = ctypes.c_void_p(), ctypes.c_void_p()
assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(primary), 0) == 0
assert lib.cuCtxGetCurrent(ctypes.byref(current)) == 0
print(x, primary.value == current.value)
"""


def test_torch_runs_in_the_context_started_early():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["6.0", "True"]
