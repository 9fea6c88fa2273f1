"""CUDA's driver started beside `import torch`: the driver's own start (`cuInit`) and the GPU's primary context
(the one torch then uses) are made on a thread through the driver's C API while the importing thread loads
torch's libraries, so an engine's "cuda_init" phase finds them made. Its cost grows with the processes that
start at once (the driver serializes them): BENCHMARKS.md, "Workers' start: CUDA's driver beside torch's import".

Nothing here can fail a start: where there is no driver, no GPU or an error, torch starts CUDA itself as
before (and reports what is wrong). `LMBATCH_EARLY_CUDA=0` turns it off.
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import Callable

from lmbatch.engine.precompile import gpu_present


def start_early(device: str) -> Callable[[], None]:
    """Start the driver and device 0's primary context on a thread, where `device` may be a GPU and one may be
    visible; what waits for it (to call before torch starts CUDA)."""
    if device not in ("auto", "cuda") or not gpu_present() or os.environ.get("LMBATCH_EARLY_CUDA") == "0":
        return lambda: None
    thread = threading.Thread(target=_retain_primary, name="lmbatch-cuda-driver", daemon=True)
    thread.start()
    return thread.join


def _retain_primary() -> None:
    """cuInit, then device 0's primary context retained (made once a process; torch's runtime takes the same
    one). A context kept by this extra reference ends with the process."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        if lib.cuInit(0) != 0:
            return
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        if lib.cuDeviceGet(ctypes.byref(dev), 0) == 0:
            lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    except (OSError, AttributeError):       # no driver library, or one without these entry points
        return
