"""The model's side of a run, on a thread of its own while the host prepares the workload: torch's
import, CUDA's start, the engine's fitting (device, dtype, sizes, attention backend), the weights,
kernels compiled or loaded, decode graphs captured and, for a run that generates, the tokenizer that
decodes its text made. Each step is timed (`Loaded.seconds`: imports, cuda_init, weights, compile,
graphs, tokenizer), and its errors (a user's too) are raised where the run takes
the result. The thread holds the interpreter lock only while it runs Python: torch's import and the
graphs' capture mostly; the host's work, when it is not cached, runs in a process of its own
(lmbatch/run/prepare.py)."""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from lmbatch.engine import precompile
from lmbatch.model.tokenizer import LazyTokenizer
from lmbatch.timing import Phases

if TYPE_CHECKING:
    from lmbatch.engine.build import Attention
    from lmbatch.engine.options import EngineSpec
    from lmbatch.engine.parallel import ParallelEngine
    from lmbatch.engine.protocol import BatchEngine


class Loaded(NamedTuple):
    engine: BatchEngine
    spec: EngineSpec            # fitted: the device, dtype, sizes and backend it runs with
    attention: Attention
    seconds: dict[str, float]   # the model's side by step, and "load_background": all of it
    layout: str = ""            # what decided the data- and tensor-parallel sizes (engine/devices.py)


class ModelLoader:
    """Builds the engine of `spec` on a background thread (started at once). `result` is the engine,
    its pool grown (the engine built again) if the longest request needs more; leaving the `with`
    block ends the engine (data-parallel workers end with the run)."""

    def __init__(self, spec: EngineSpec, tokenizer: Any, user_pool: bool, work: float | None = None,
                 graphs: bool = False):
        """`tokenizer`: the engine's (a LazyTokenizer: made only if it decodes); `user_pool`: the user set
        the pool's size (too small is an error, not grown); `work`: the job's model FLOPs where known
        (`devices.layout`: a small job runs on one engine); `graphs`: capture the decode graphs once the
        engine is built (as `capture_graphs` asks later)."""
        self.spec, self.tokenizer, self.user_pool, self.work = spec, tokenizer, user_pool, work
        self.loaded: Loaded | None = None
        self.error: BaseException | None = None
        # set once torch and the model's code are imported: the step that most needs the interpreter lock
        self.imported = threading.Event()
        self._lock = threading.Lock()
        self._built = False             # the engine is built (or its build failed)
        self._graphs = graphs           # capture the decode graphs once it is
        self.precompile: precompile.Precompile | None = None   # helpers compiling the graphs' kernels
        self.thread = threading.Thread(target=self._load, name="lmbatch-model-load", daemon=True)
        self.thread.start()

    def capture_graphs(self) -> None:
        """Capture the decode graphs on the model's side as soon as the engine is built, for a run that
        learns it will generate only after its load began (`lmbatch lm-eval`, once it knows its tasks):
        on this thread if the load is under way, else on a thread of its own that `result` waits for.
        An engine of several processes captures its graphs as its spec says (`graphs_ahead`)."""
        with self._lock:
            self._graphs = True
            if not self._built:
                return          # _load captures them
        load = self.thread

        def capture() -> None:
            load.join()
            self._capture()

        self.thread = threading.Thread(target=capture, name="lmbatch-graphs", daemon=True)
        self.thread.start()

    def _stop_helpers(self) -> None:
        with self._lock:
            helpers, self.precompile = self.precompile, None
        if helpers is not None:
            helpers.close()

    def _capture(self) -> None:
        runner = getattr(self.loaded.engine, "model_runner", None) if self.loaded is not None else None
        if runner is None or self.loaded is None or "graphs" in self.loaded.seconds:
            return
        t = time.perf_counter()
        try:
            runner.capture_graphs()
            with self._lock:
                helpers = self.precompile
            if helpers is not None:
                helpers.captured()
            if isinstance(self.tokenizer, LazyTokenizer):
                self.tokenizer.ready_to_decode()    # the run decodes text: made ready here, not in its first step
        except BaseException as e:  # noqa: BLE001  raised on the run's thread
            self.error = e
        finally:
            self._stop_helpers()
        self.loaded.seconds["graphs"] = time.perf_counter() - t

    def __enter__(self) -> ModelLoader:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is not None and not issubclass(kind, Exception):
            return      # Ctrl-C: the command exits at once, whatever the thread is doing
        self.thread.join()      # a thread killed inside torch at exit aborts the process (no message)
        self._stop_helpers()
        if self.loaded is not None:
            self.loaded.engine.close()

    def _load(self) -> None:
        t = time.perf_counter()
        try:
            self.loaded = self._build()
        except BaseException as e:  # noqa: BLE001  raised on the run's thread
            self.error = e
        self.imported.set()
        with self._lock:
            self._built, graphs = True, self._graphs
        if graphs:
            self._capture()
        if self.loaded is not None:
            self.loaded.seconds["load_background"] = time.perf_counter() - t

    def _build(self) -> Loaded:
        """The engine: worker processes, started at once (each imports torch and fits its own engine),
        where the run spans several devices; else built here."""
        from lmbatch.engine.build import several
        from lmbatch.engine.devices import resolved
        from lmbatch.engine.driver import start_early
        from lmbatch.model.checkpoint import model_config

        clock = Phases(since_start=False)
        cfg = model_config(self.spec.model_dir)
        spec, layout = resolved(self.spec, cfg, self.work)
        if several(spec):
            self.imported.set()         # this process imports no torch: its workers do
            workers = make_parallel(spec, clock)
            return Loaded(workers, workers.spec, workers.attention, {**workers.seconds, **clock.seconds}, layout)
        with self._lock:
            graphs = spec.graphs_ahead or self._graphs
        if precompile.wanted(spec, graphs) and cfg.runtime == "native":
            self.precompile = precompile.Precompile(spec)   # importing torch beside this thread
        started = start_early(spec.device)   # beside the imports
        with clock("imports"):
            import torch  # noqa: F401

            from lmbatch.engine.build import fit, start_cuda
        self.imported.set()
        with clock("cuda_init"):
            started()
            spec, attention = fit(spec, cfg)
            start_cuda(spec.device)
        if self.precompile is not None:     # started only where the graphs are captured as the engine is built
            with clock("helpers"):
                self.precompile.go(spec, cfg)
        engine = make_engine(spec, self.tokenizer, clock)
        if spec.graphs_ahead and self.precompile is not None:
            self.precompile.captured()
        if spec.graphs_ahead and isinstance(self.tokenizer, LazyTokenizer):
            with clock("tokenizer"):        # a run that generates decodes text: made here, not in its first step
                self.tokenizer.ready_to_decode()
        return Loaded(engine, spec, attention, dict(clock.seconds), layout)

    def result(self, longest: int) -> Loaded:
        """The engine, its pool able to hold the longest request plus a batch."""
        from lmbatch.engine.build import fit_pool

        self.thread.join()
        self._stop_helpers()        # the graphs are captured, or no run asked for them before its first batch
        if self.error is not None:
            raise self.error
        assert self.loaded is not None
        spec = fit_pool(self.loaded.spec, longest, self.user_pool)
        if spec is not self.loaded.spec:        # rare (prompts near the model's context): the small pool goes first
            self.loaded.engine.close()
            old, self.loaded = self.loaded, None
            self.loaded = old._replace(engine=make_engine(spec, self.tokenizer), spec=spec)
        return self.loaded


def make_engine(spec: EngineSpec, tokenizer: object = None, clock: Phases | None = None) -> BatchEngine:
    """A spec's engine, warmed up: in this process (the spec fitted), or `spec.workers` engines of
    `spec.ranks` processes each (ParallelEngine: each fits its own), on this machine or placed by a Ray
    cluster. `clock` times its steps: weights, compile (the first batch's kernels), graphs (or workers)."""
    from lmbatch.engine.build import build_engine, several

    clock = clock or Phases(since_start=False)
    if several(spec):
        return make_parallel(spec, clock)
    return build_engine(spec, tokenizer, clock)


def make_parallel(spec: EngineSpec, clock: Phases) -> ParallelEngine:
    """The worker processes of a spec whose sizes are decided, each ready (`clock`: "workers")."""
    from lmbatch.engine.build import gpus
    from lmbatch.engine.parallel import ParallelEngine
    from lmbatch.model.checkpoint import model_config

    with clock("workers"):
        local = spec.device == "cuda" and not spec.ray_address
        return ParallelEngine(spec, model_config(spec.model_dir),
                              gpus(spec.workers * spec.ranks, spec.gpu_share) if local else None)
