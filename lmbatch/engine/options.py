"""What an engine is built from: its own settings (`EngineOptions`) and where it runs (`EngineSpec`), declared
once for `lmbatch run`, the lm-eval backend and every data-parallel worker. No torch import: the run layer
declares them before it loads anything; engine/build.py fits what they leave open and builds the engine."""
from __future__ import annotations

from dataclasses import dataclass

MASK_MODES = ("overlap", "lazy", "eager")   # when grammar rows fill their token masks (engine/sampler.py)


DECODE_ROWS = 512           # decode rows of an engine whose options were not fitted, and of most runs
SMALL_DECODE_ROWS = 1024    # of a run whose host sets the pace (build.decode_rows), and of a stream of many
                            # generations on a small model (`wide_rows`): a step reads the weights for twice the
                            # rows, and there are half as many steps
WIDE_FROM = 4096            # generations a stream holds at least to decode with `wide_rows` (engine/stream.py)


@dataclass(frozen=True)
class EngineOptions:
    kv_cache_tokens: int | None = 32768         # KV pool size (None: fitted to the device, engine/build.py)
    max_tokens_per_batch: int | None = 4096     # prefill batch budget (None: likewise)
    attention: str | None = None        # backend name (lmbatch.attention.BACKENDS); None: the device's default
    cache: bool = True                  # reuse KV across requests (the radix cache)
    max_running: int | None = None      # decode rows (None: fitted, engine/build.py; unfitted: DECODE_ROWS)
    wide_rows: int | None = None        # ... of a stream of WIDE_FROM generations or more (None: max_running)
    cuda_graphs: bool = True            # replay decode steps as CUDA graphs (CUDA only)
    jump_forward: bool = True           # append grammar-forced text without decoding it
    masks: str = "overlap"              # when grammar rows fill their token masks (MASK_MODES)
    deterministic: bool = False         # every logprob and token independent of the batch (ModelRunner)
    fp8_gemm: bool | None = None        # an FP8 checkpoint's linear layers as FP8 GEMMs (model/fp8.py), else its
    # weights dequantized on load; None: fitted (engine/build.py: on a GPU with FP8 tensor cores)
    threads: int | None = None          # CPU: torch threads of every forward batch (None: engine/threads.py's policy)

    def __post_init__(self) -> None:
        if self.masks not in MASK_MODES:
            raise ValueError(f"masks must be one of {MASK_MODES}, not {self.masks!r}")


@dataclass(frozen=True)
class EngineSpec:
    """An engine to build. `devices.resolved` decides its data- and tensor-parallel sizes where they are
    "auto"; `build.fit` turns the rest a user left open (device "auto", dtype None, the options' sizes
    None, attention "auto") into values, for each engine where it runs."""
    model_dir: str
    device: str = "auto"                # auto (CUDA when a GPU is visible), cpu or cuda
    dtype: str | None = None            # None: float32 on CPU, bfloat16 on CUDA
    options: EngineOptions = EngineOptions()
    data_parallel: int | str = 1        # engines, each in its own process ("auto": engine/devices.py)
    tensor_parallel: int | str = 1      # devices (processes) each engine's model is split over (likewise)
    ray_address: str | None = None      # place the processes on this Ray cluster
    relay_s: float = 1.0                # a worker hands its finished results over at least this often
    load_format: str = "auto"           # "dummy": random weights (speed work)
    graphs_ahead: bool = True           # capture decode graphs as the engine is built (else at the first decode)
    threads: int | None = None          # torch threads of each CPU process (default: the cores shared out)
    gpu_share: int = 1                  # workers on each GPU (more: they share its memory and its time)
    stages: int = 1                     # the workload's calls one after another (`Workload.stages`: auto's)

    @property
    def workers(self) -> int:
        return int(self.data_parallel)

    @property
    def ranks(self) -> int:
        """Processes each engine is (its model split over them)."""
        return int(self.tensor_parallel)
