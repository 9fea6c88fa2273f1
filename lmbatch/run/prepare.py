"""The host's side of a run, before any model work: the task's instances, every program run up to its
first wait with its calls tokenized and checked, and the first wave planned.

A built-in task's prepared workload (`workload_cache.Snapshot`) comes from one of three places:
- the workload cache, read back in a fraction of the seconds preparing it takes;
- a forked child process, which prepares it (and writes it to the cache) while this process loads
  the model: the two share no interpreter lock, so neither slows the other;
- this process: a dry run, a program file (whose code runs here, once), or where fork is missing.
The programs then run their first stage here, taking the snapshot's token ids wherever a call's text
is the same, and the first wave takes the snapshot's plan when the run holds every instance.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from lmbatch.caches import workloads as workload_cache
from lmbatch.caches.workloads import Snapshot
from lmbatch.errors import UserError
from lmbatch.frontend.calls import CallOptions, KnownIds
from lmbatch.frontend.chat import ChatOptions, has_template
from lmbatch.frontend.interpreter import Interpreter
from lmbatch.frontend.tokenize import TextEncoder
from lmbatch.frontend.workload import LoadArgs, Workload
from lmbatch.model.config import ModelConfig
from lmbatch.options import RunOptions
from lmbatch.requests import ScoreRequest
from lmbatch.run.identity import cache_options
from lmbatch.scheduler.planner import summarize
from lmbatch.timing import Phases


class ModelFiles(NamedTuple):
    """The model folder as the host needs it: where it is, its tokenizer, its shape."""
    dir: Path
    encoder: TextEncoder
    shape: ModelConfig


def _interpreter(o: RunOptions, model: ModelFiles) -> Interpreter:
    # a context length of 0: the config names none (ALiBi models run through transformers, e.g. BLOOM)
    wo = o.workload
    calls = CallOptions(max_len=model.shape.max_position_embeddings or 1 << 30, truncate_left=wo.truncate_left,
                        vocab_size=model.shape.vocab_size, jump_forward=o.engine.jump_forward,
                        think_budget=wo.think_budget, think_end=wo.think_end)
    return Interpreter(model.encoder, calls, schedule=o.engine.schedule, seed=wo.seed)


def _figures(interp: Interpreter) -> dict[str, Any]:
    """A dry run's figures of the first stage: calls, requests (executed: equal scored prompts merged),
    prompt and unique tokens, the optimum, and what the planned prefill attends and needs logits of
    (from the first wave's plan where it is made, else from the prompts' sorted order)."""
    requests = interp.first_requests()
    scored = [isinstance(r, ScoreRequest) for r in requests]
    rows = [len(r.continuation) if isinstance(r, ScoreRequest) else 1 for r in requests]
    plan = interp.first_plan.summary(rows) if interp.first_plan is not None else \
        summarize([r.prompt for r in requests], scored, rows)
    return {"calls": len(interp.ready), "requests": plan.requests, "executed_requests": plan.executed,
            "prompt_tokens": plan.prompt_tokens, "unique_tokens": plan.unique_tokens,
            "optimal_hit_rate": plan.optimal_hit_rate, "attended_keys": plan.attended_keys,
            "logit_rows": plan.logit_rows}


def _move_tokenize(clock: Phases, interp: Interpreter, phase: str, before: float) -> None:
    """The interpreter's tokenizing, timed inside `phase`, counts as its own phase."""
    spent = interp.tokenize_s - before
    clock.seconds[phase] -= spent
    clock.add("tokenize", spent)


def build(o: RunOptions, w: Workload, model: ModelFiles, clock: Phases) -> tuple[Snapshot, Interpreter]:
    """Prepare the workload here: its snapshot, and the interpreter whose programs made it."""
    with clock("data"):
        wo = o.workload
        chat = ChatOptions(wo.apply_chat_template, wo.system_instruction, wo.fewshot_as_multiturn)
        if chat.apply and not has_template(model.encoder.hf):
            raise UserError("--apply-chat-template: the model's tokenizer has no chat template")
        instances = w.instances(LoadArgs(model.encoder, w.shots(wo.shots), wo.limit, wo.subjects, wo.seed, chat))
        if not instances:
            raise UserError(f"{w.name} has no instances to run")
        for inst in instances:      # a suite's name theirs already
            inst.task = inst.task or w.name
        interp = _interpreter(o, model)
        known: KnownIds = {}
        interp.start(w.programs, instances, record=known)
    _move_tokenize(clock, interp, "data", 0.0)
    with clock("plan"):
        interp.plan_first_wave()
        figures = _figures(interp)
    return Snapshot(instances, known, interp.first_plan, figures), interp


def start(o: RunOptions, w: Workload, model: ModelFiles, snap: Snapshot, numbers: list[int],
          clock: Phases) -> Interpreter:
    """The programs of instances `numbers` run to their first wait here, with the snapshot's token ids;
    the first wave takes its plan when they are all there."""
    interp = _interpreter(o, model)
    with clock("data"):
        interp.start(w.programs, [snap.instances[k] for k in numbers], numbers, known=snap.known)
    _move_tokenize(clock, interp, "data", 0.0)
    with clock("plan"):
        interp.plan_first_wave(snap.plan if len(numbers) == len(snap.instances) else None)
    return interp


class Preparation:
    """Where this run's workload comes from (see the module's docstring). Start it before any thread
    (a forked child must not inherit one); `close` ends a child still at work. A cached workload is read
    when first asked for (`snapshot`), so that the model's loading can start first; its dry-run figures
    are in the entry's header (`figures`)."""

    def __init__(self, o: RunOptions, w: Workload, model: ModelFiles, clock: Phases, fork: bool):
        self.o, self.w, self.model, self.clock = o, w, model, clock
        self.source = "here"
        self.snap: Snapshot | None = None
        self.interp: Interpreter | None = None       # made here: its programs ran their first stage already
        self.path: Path | None = None
        self.child: _Child | None = None
        if o.output.workload_cache and w.data_files is not None:
            with clock("data"):
                self.path = workload_cache.path_of(workload_cache.key(cache_options(o, w, model.shape), w.data_files(),
                                                                      model.dir))
            if self.path.is_file():
                self.source = "cache"
        if self.source != "cache" and fork and w.data_files is not None and hasattr(os, "fork"):
            self.child = _Child(self._in_child)
            self.source = "child"

    def figures(self) -> dict[str, Any] | None:
        """The workload's dry-run figures where the cache holds it (from its entry's header), else None."""
        note = workload_cache.read_note(self.path) if self.source == "cache" and self.path is not None else None
        return note.get("figures") if isinstance(note, dict) else None

    def _in_child(self) -> dict[str, Any]:
        clock = Phases()
        snap, _ = build(self.o, self.w, self.model, clock)
        dest = self.path
        if dest is None or not workload_cache.store(dest, snap):
            fd, name = tempfile.mkstemp(prefix="lmbatch-workload-", suffix=".pkl")
            os.close(fd)
            dest = Path(name)
            if not workload_cache.store(dest, snap, temporary=True):
                raise OSError(f"cannot write the prepared workload to {dest}")
        return {"phases": {k: clock.seconds.get(k, 0.0) for k in ("data", "tokenize", "plan")}, "path": str(dest)}

    def snapshot(self) -> Snapshot:
        """The workload, once prepared (read from the cache, or waited for from the child preparing it)."""
        if self.snap is None and self.source == "cache" and self.path is not None:
            with self.clock("data"):
                self.snap = workload_cache.load(self.path)
            if self.snap is None:       # gone, or unreadable (said): prepared here
                self.source = "here"
        if self.snap is None and self.child is not None:
            child, self.child = self.child, None
            self.snap = child.result(self.path, self.clock)
            if self.snap is None:
                self.source = "here"
        if self.snap is None:
            self.snap, self.interp = build(self.o, self.w, self.model, self.clock)
            if self.path is not None:
                workload_cache.store(self.path, self.snap)
        return self.snap

    def interpreter(self, numbers: list[int]) -> Interpreter:
        """The interpreter of instances `numbers` (all of them, unless a resumed run kept some)."""
        snap = self.snapshot()
        if self.interp is not None and len(numbers) == len(snap.instances):
            return self.interp
        return start(self.o, self.w, self.model, snap, numbers, self.clock)

    def close(self) -> None:
        if self.child is not None:
            self.child.kill()
            self.child = None


class _Child:
    """A forked process that runs `work()` (it writes a snapshot file and returns where, and its phases)
    and reports in one JSON message: that, a user's error, or another error."""

    def __init__(self, work: Any):
        sys.stdout.flush()
        sys.stderr.flush()
        read, write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:       # the child: never returns
            os.close(read)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            try:
                msg: dict[str, Any] = work()
            except UserError as e:
                msg = {"user_error": str(e)}
            except BaseException as e:  # noqa: BLE001  the parent prepares again, where it raises for real
                msg = {"error": f"{type(e).__name__}: {e}"}
            os.write(write, json.dumps(msg).encode())
            os._exit(0)
        os.close(write)
        self.read = read

    def result(self, cache: Path | None, clock: Phases) -> Snapshot | None:
        """The child's snapshot, or None if it failed otherwise than by a user's error (raised here)."""
        chunks = []
        while chunk := os.read(self.read, 1 << 16):
            chunks.append(chunk)
        os.close(self.read)
        os.waitpid(self.pid, 0)
        self.pid = 0
        msg = json.loads(b"".join(chunks) or b"{}")
        if "user_error" in msg:
            raise UserError(msg["user_error"])
        if "path" not in msg:
            return None
        for phase, seconds in msg["phases"].items():
            clock.add(phase, seconds)
        path = Path(msg["path"])
        snap = workload_cache.load(path)
        if path != cache:           # a temporary file (the cache was not writable)
            path.unlink(missing_ok=True)
        return snap

    def kill(self) -> None:
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except OSError:
                pass
            self.pid = 0
