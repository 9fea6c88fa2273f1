"""Kernel tests under Triton's interpreter on the CPU: the interpreter is chosen when `triton.jit` runs
(TRITON_INTERPRET=1 at import), so a test's script runs in a process of its own, after PRELUDE, and prints
its results as JSON on its last line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# numpy 2 refuses int() of a 1-element array, and Triton's scalars are such arrays in its interpreter
# (triton 3.5, 3.6): a tensor's __index__ reads its one element
PRELUDE = r'''
import triton.runtime.interpreter as interp

_patch = interp._patch_lang_tensor
def _index_of_one(tensor, *scope):
    _patch(tensor, *scope)
    index = lambda self: int(self.handle.data.reshape(-1)[0])
    scope[0].set_attr(tensor, "__index__", index) if scope else setattr(tensor, "__index__", index)
interp._patch_lang_tensor = _index_of_one
'''


def interpreted(script: str, *args: str, timeout: int = 900) -> Any:
    """`script` (after PRELUDE) with `args` under the interpreter; its last line of output, parsed."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", PRELUDE + script, *args], capture_output=True, text=True, env=env,
                       timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def interpreted_each(script: str, cases: list[tuple[str, ...]], timeout: int = 900) -> list[Any]:
    """`interpreted(script, *args)` for each `args` of `cases`, each in a process of its own, as many side by
    side as this process may use cores (the interpreter runs on one): the results in the order of `cases`."""
    workers = max(1, min(len(cases), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                         else os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda args: interpreted(script, *args, timeout=timeout), cases))
