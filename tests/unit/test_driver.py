"""CUDA's driver started beside torch's import (engine/driver.py): only where a GPU may be used and may be
visible, never when turned off, and never failing a start where the driver library is missing or refuses."""
from __future__ import annotations

import pytest

from lmbatch.engine import driver


@pytest.fixture
def calls(monkeypatch):
    """The driver library's entry points called, in order (a fake library: this machine has none)."""
    seen: list[str] = []

    class Lib:
        def __getattr__(self, name):
            def call(*args):
                seen.append(name)
                return 0
            return call

    monkeypatch.setattr(driver.ctypes, "CDLL", lambda name: Lib() if name == "libcuda.so.1" else None)
    monkeypatch.setattr(driver, "gpu_present", lambda: True)
    monkeypatch.delenv("LMBATCH_EARLY_CUDA", raising=False)
    return seen


def test_the_driver_and_primary_context_start_on_a_thread(calls):
    wait = driver.start_early("auto")
    wait()
    assert calls == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain"]


def test_nothing_starts_for_the_cpu_without_a_gpu_or_when_turned_off(calls, monkeypatch):
    driver.start_early("cpu")()
    monkeypatch.setenv("LMBATCH_EARLY_CUDA", "0")
    driver.start_early("cuda")()
    monkeypatch.delenv("LMBATCH_EARLY_CUDA")
    monkeypatch.setattr(driver, "gpu_present", lambda: False)
    driver.start_early("auto")()
    assert calls == []


def test_a_missing_or_refusing_driver_fails_nothing(monkeypatch):
    monkeypatch.setattr(driver, "gpu_present", lambda: True)
    monkeypatch.delenv("LMBATCH_EARLY_CUDA", raising=False)

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(driver.ctypes, "CDLL", missing)
    driver.start_early("cuda")()

    seen = []

    class Refusing:
        def cuInit(self, flags):
            seen.append("cuInit")
            return 100      # CUDA_ERROR_NO_DEVICE: nothing else is called
    monkeypatch.setattr(driver.ctypes, "CDLL", lambda name: Refusing())
    driver.start_early("cuda")()
    assert seen == ["cuInit"]
