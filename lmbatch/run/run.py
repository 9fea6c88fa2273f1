"""`lmbatch run`, top to bottom: options -> workload -> model files -> run directory -> engine ->
execute -> summary. Each step is a module of its own (options, prepare, identity and rundir, loading,
parts, summary); data flows down, and results come back as return values or as the finished programs the
run pulls from the interpreter.

What a user waits for is the whole command, so every phase is timed from the process's start
(`summary.json` `time_s`). The model is built on a thread of its own (lmbatch/run/loading.py) while the
host prepares the workload: read back from the workload cache, or prepared by a forked child
process (lmbatch/run/prepare.py).
"""
from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from lmbatch.errors import Interrupted, UserError, first_line
from lmbatch.frontend.workload import Workload
from lmbatch.options import RunOptions, check, engine_spec
from lmbatch.programs.registry import get_workload
from lmbatch.run import identity, summary
from lmbatch.run.loading import ModelLoader
from lmbatch.run.parts import Every, PartWriter, Stop
from lmbatch.run.prepare import ModelFiles, Preparation
from lmbatch.run.progress import TokenProgress
from lmbatch.run.spread import run_spread, spread_works
from lmbatch.rundir import place, resume
from lmbatch.rundir.rundir import RunDir
from lmbatch.timing import Phases

if TYPE_CHECKING:
    from lmbatch.engine.protocol import BatchEngine
    from lmbatch.frontend.interpreter import Interpreter
    from lmbatch.run.spread import Programs

PARALLEL_PART_S = 2.0       # seconds between parts at most, where workers run the model


def run(o: RunOptions) -> Path | dict[str, Any]:
    """Run a task; returns its run directory, or with `dry_run` the plan's figures."""
    clock = Phases()
    w = get_workload(o.workload.task)
    check(o, w)
    stop = Stop()
    try:
        with HostGC() as host_gc, stop:
            with clock("model_files"):
                model = open_model(o)
            if o.output.dry_run:
                return dry_run(o, w, model, clock)
            with clock("model_files"):
                rundir = stop.rundir = open_rundir(o, w, model.dir)
            try:
                return run_in(o, w, model, rundir, Watch(stop, host_gc, clock))
            finally:
                rundir.release()
    except KeyboardInterrupt:
        raise Interrupted(stop.kept()) from None


def open_rundir(o: RunOptions, w: Workload, model_dir: Path) -> RunDir:
    """The run's directory, `--out`/`--run-id` (default: task-shots-model-time): claimed for this run (inside
    --out, locked; a complete run needs --overwrite, a folder that is no run directory is never replaced),
    then what it keeps for this run's fingerprint (an incomplete run of the same one is resumed)."""
    claim = place.claim(Path(o.output.out), identity.run_id(o, w, model_dir), o.output.overwrite)
    try:
        fingerprint = identity.fingerprint(o, w, model_dir)
        kept = resume.kept(claim, fingerprint, o.output.overwrite)
        return RunDir.claimed(claim, fingerprint, kept, o.output.save_token_ids, named=o.output.run_id is not None)
    except BaseException:
        claim.release()
        raise


class Watch(NamedTuple):
    """What watches over a run: its Ctrl-C handling, the host's garbage collection, its phase clock."""
    stop: Stop
    host_gc: HostGC
    clock: Phases


def run_in(o: RunOptions, w: Workload, model: ModelFiles, rundir: RunDir, watch: Watch) -> Path:
    """The run itself, into its run directory: workload and engine side by side, then execute, then summary."""
    stop, host_gc, clock = watch
    say = (lambda text: None) if o.output.quiet else (lambda text: print(f"lmbatch: {text}", file=sys.stderr))
    if rundir.resuming:
        say(f"resuming {rundir.path}: {len(rundir.saved)} instances kept from earlier attempts")
    prep = Preparation(o, w, model, clock, fork=True)       # before the model's thread: it may fork
    spec = engine_spec(o, model.dir, w.generates, w.stages)
    try:
        user_pool = o.engine.kv_cache_tokens is not None
        with ModelLoader(spec, model.encoder.hf_source, user_pool, model_work(w, prep)) as loader:
            say(f"{w.name}: " + ("reading the cached workload" if prep.source == "cache" else
                                 "loading, tokenizing and planning the instances") + ", the model loading meanwhile")
            if prep.source == "cache":      # seconds of imports on the model's thread go first: with this
                with clock("load"):         # Python work beside them, both took several times as long
                    loader.imported.wait()
            ids = [inst.id for inst in prep.snapshot().instances]
            interp = prep.interpreter(rundir.unsaved(ids))
            say(f"{len(interp.runs)} instances to run, {len(interp.ready)} first-stage calls planned")
            if loader.thread.is_alive():
                say(f"waiting for the model ({model.dir.name})")
            with clock("load"):
                loaded = loader.result(interp.longest_ready())
            if not rundir.check_dtype(str(loaded.spec.dtype), o.output.overwrite):   # --overwrite of another dtype's
                interp = prep.interpreter(rundir.unsaved(ids))
            host_gc.model_work()
            tokenized = interp.tokenize_s
            works = spread_works(o, w, interp, loaded.engine, prep.snapshot().known, model.dir)
            execute(o, interp, loaded.engine, PartWriter(w, rundir, interp.tally), stop, works)
            clock.add("tokenize", interp.tokenize_s - tokenized)
            clock.add("plan", interp.stats.plan_s)
            clock.add("execute", interp.stats.execute_s)
            with clock("write"):
                merged = rundir.merge(interp.stats.execute_s)
            result = summary.build(o, w, loaded, merged, interp,
                                   summary.RunFacts(rundir.path.name, clock.total(), prep.source))
            rundir.finish(result)
    finally:
        prep.close()
    if not o.output.quiet:
        print(f"{summary.closing_line(result)}  -> {rundir.path}", file=sys.stderr)
    return rundir.path


def model_work(w: Workload, prep: Preparation) -> float | None:
    """FLOPs of the model's work where they are known before it starts: a cached workload that only scores
    (its first stage is all of it). None otherwise."""
    figures = prep.figures()
    if figures is None or w.generates:
        return None
    return summary.estimate_flops(prep.model.shape, figures["unique_tokens"], figures["attended_keys"],
                                  figures["logit_rows"])


def open_model(o: RunOptions) -> ModelFiles:
    """The model folder (the embedded model converted on first use), its tokenizer and its shape, checked."""
    from lmbatch.frontend.tokenize import TextEncoder
    from lmbatch.model.checkpoint import model_config, resolve_model

    model_dir = resolve_model(o.engine.model)
    encoder = TextEncoder.for_model(model_dir)
    shape = model_config(model_dir)
    if o.engine.tensor_parallel != "auto" and int(o.engine.tensor_parallel) > 1:
        from lmbatch.model.tensor_parallel import shard_config
        try:
            shard_config(shape, int(o.engine.tensor_parallel))
        except ValueError as e:
            raise UserError(f"--tensor-parallel {o.engine.tensor_parallel}: {first_line(e)}") from None
    return ModelFiles(model_dir, encoder, shape)


def dry_run(o: RunOptions, w: Workload, model: ModelFiles, clock: Phases) -> dict[str, Any]:
    """Load, tokenize and plan (or read the cached workload), no model work: the plan's figures."""
    prep = Preparation(o, w, model, clock, fork=False)
    snap = prep.snapshot()
    tasks: dict[str, int] = {}
    for inst in snap.instances:
        tasks[inst.task] = tasks.get(inst.task, 0) + 1
    return summary.dry_run(o, w, model, tasks, snap.figures, clock.total())


def execute(o: RunOptions, interp: Interpreter, engine: BatchEngine, parts: PartWriter, stop: Stop,
            works: dict[int, Programs] | None = None) -> None:
    """Run every program; finished ones go to the run directory as parts every --checkpoint-s seconds of
    work, and at once when a stop is asked for (then the run raises Interrupted). `works`: each data-parallel
    worker's share of the programs, which it runs whole (lmbatch/run/spread.py)."""
    progress = TokenProgress("execute", disable=o.output.quiet)
    # workers' results come to this process as they finish: a part written meanwhile costs their GPUs nothing,
    # and what is left to write when the last ends is small
    every = o.output.checkpoint_s if engine.data_parallel == 1 else min(o.output.checkpoint_s, PARALLEL_PART_S)
    stop.executing = True
    try:
        if works is not None:
            run_spread(interp, engine, works, parts, progress, Every(every, stop))
        else:
            for finished in interp.stream(engine, handover_due=Every(every, stop), progress=progress,
                                          settle=True):
                parts.write(finished)
                if stop.asked:
                    raise Interrupted(stop.kept())
    finally:        # a stop's line starts a line of its own, under the bar
        stop.executing = False
        progress.close()
    rundir = parts.rundir
    if rundir.unsaved_count:
        raise RuntimeError(f"{rundir.unsaved_count} of {rundir.total} instances were not written")


class HostGC:
    """Python's cycle collector rescans every live container each time their number grows by a quarter;
    the host phases build millions (instances, prompts, token lists) and that scanning took about a third
    of their time (full MMLU's dry run on a 2-core CPU: ~14.8 s with it, ~8.8 s without). They run
    without it; what they built is frozen (never scanned again) before model work, which runs with the
    collector (generation may leave cycles that hold device memory), each wave's survivors frozen before
    the next (`interpreter.settled_host_work`); everything is unfrozen at the run's end."""

    def __enter__(self) -> HostGC:
        self.was_enabled = gc.isenabled()
        gc.disable()
        return self

    def model_work(self) -> None:
        gc.freeze()
        if self.was_enabled:
            gc.enable()

    def __exit__(self, *exc: object) -> None:
        gc.unfreeze()
        if self.was_enabled:
            gc.enable()
