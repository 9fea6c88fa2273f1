"""Runs a whole batch of LM programs on the engine, in waves.

Every program runs in its own greenlet until it waits for a model result. The calls queued by all
waiting programs form a wave, executed as one engine batch (planned as a radix tree, in DFS order).
The first wave holds the first-stage calls of every instance, so the offline tree covers them all.
Later calls depend on generated text; they join the next wave once their program has them, picked
by longest cached prefix in the live tree (SGLang's online approximation of DFS), with the new
tokens of a wave's generation calls capped so that what they leave in the cache is still there when
their programs' next calls arrive. Score calls (select) always join: they leave nothing behind.
"""
from __future__ import annotations

import operator
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, cast

import greenlet

from lmbatch.errors import UserError
from lmbatch.frontend.dsl import Gen, Pending, Select, State
from lmbatch.frontend.tokenize import TextEncoder
from lmbatch.frontend.workload import Instance
from lmbatch.requests import GenerateRequest, RunStats, SamplingParams, ScoreRequest
from lmbatch.scheduler.planner import Plan, plan_requests, posthoc_unique, summarize

if TYPE_CHECKING:      # the engine (and torch) load on the runner's model thread, not here
    from lmbatch.engine import Engine
    from lmbatch.grammar import GrammarCompiler  # imports xgrammar: loaded on the first constraint


@dataclass
class StageCounts:
    calls: int = 0
    requests: int = 0               # engine requests (a select has one per choice)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    decode_tokens: int = 0


@dataclass(eq=False)
class ProgramRun:
    """One instance's program while it runs."""
    index: int
    instance: Instance
    interp: "Interpreter"
    state: State | None = None
    glet: greenlet.greenlet | None = None
    stage: int = 0
    calls: list[Pending] = field(default_factory=list)
    error: str | None = None
    user_error: UserError | None = None
    tokens: StageCounts = field(default_factory=lambda: StageCounts())
    started: bool = False           # some call of it has been in a wave

    @property
    def footprint(self) -> int:
        """Tokens this program has put into the cache (prefill and decode)."""
        return self.tokens.computed_tokens + self.tokens.decode_tokens

    def submit(self, op: Gen | Select, prompt: str) -> Pending:
        p = Pending(op, prompt, self, self.stage, len(self.calls))
        self.calls.append(p)
        self.interp.ready.append(p)
        return p

    def wait(self, pending: list[Pending]) -> None:
        if not pending:
            return
        if greenlet.getcurrent() is not self.glet:
            raise RuntimeError("a program's results were read before they were computed")
        while not all(p.done for p in pending):
            self.interp.hub.switch()
        self.stage += 1

    @property
    def finished(self) -> bool:
        return self.glet is None or self.glet.dead


class Interpreter:
    def __init__(self, tokenizer: TextEncoder | Any, *, max_len: int, schedule: str = "dfs", seed: int = 0,
                 truncate_left: bool = False, progress: Callable[[int, RunStats], None] | None = None,
                 vocab_size: int | None = None, jump_forward: bool = True, grammar_cache: bool = True):
        # a TextEncoder, or a transformers fast tokenizer it is made from
        self.encoder = tokenizer if isinstance(tokenizer, TextEncoder) else TextEncoder.from_hf(tokenizer)
        self.max_len = max_len
        self.vocab_size, self.jump_forward, self.grammar_cache = vocab_size, jump_forward, grammar_cache
        self.grammars: GrammarCompiler | None = None    # made on the first constraint
        self.schedule, self.seed, self.truncate_left, self.progress = schedule, seed, truncate_left, progress
        self.engine: Engine | None = None
        self._ahead: tuple[list[Pending], Plan] | None = None     # the first wave, planned ahead
        self.runs: list[ProgramRun] = []
        self.ready: list[Pending] = []
        self.hub = greenlet.getcurrent()
        self.stats = RunStats()
        self.stages: dict[int, StageCounts] = {}
        self.request_rows: list[dict] = []
        self.truncated = 0
        self.tokenize_s = 0.0           # tokenizing calls' prompts, over every wave
        self.max_final_footprint = 0   # largest cache footprint of a finished program
        self.waves = 0
        self._prompts: list[list[int]] = []            # executed prompts, for the post-hoc optimum
        self._generated: list[tuple[list[int], int]] = []  # (prompt + fed output, prompt length)

    # ---- calls ----------------------------------------------------------------------------
    def _tokenize(self, pending: list[Pending]) -> None:
        """Token ids of queued calls (each distinct text segment tokenized once), checked against
        the model's context. A call that cannot run fails its program."""
        t0 = time.perf_counter()
        try:
            self._tokenize_calls(pending)
        finally:
            self.tokenize_s += time.perf_counter() - t0

    def _tokenize_calls(self, pending: list[Pending]) -> None:
        gens, selects = [], []
        for p in pending:
            if isinstance(p.op, Select):
                selects.append(p)
                continue
            if p.op.regex is not None or p.op.json_schema is not None:
                try:
                    self._constrain(p)
                except ValueError as e:
                    p.meta["_bad"] = str(e)
            gens.append(p)
        ids: dict[int, Any] = {}
        pairs = [(p.prompt, cast(Select, p.op).choices) for p in selects]
        for p, pair in zip(selects, self.encoder.encode_choices(pairs)):
            ids[id(p)] = pair
        for p, one in zip(gens, self.encoder.encode([p.prompt + p.meta.get("forced", "") for p in gens])):
            ids[id(p)] = one
        for p in pending:
            try:
                if "_bad" in p.meta:
                    raise UserError(f"instance {p.owner.instance.id}: gen {p.op.name!r}: {p.meta.pop('_bad')}")
                p.meta["_ids"] = self._check(p, ids[id(p)])
            except (UserError, ValueError) as e:
                self._fail(p, str(e))

    def _constrain(self, p: Pending) -> None:
        """Compile the call's grammar (once per run, unless grammar_cache is off) and give it its own
        matcher; with jump-forward, the text the grammar forces at the start joins the prompt."""
        try:
            from lmbatch.grammar import GrammarCompiler
        except ImportError as e:
            raise ValueError(f"constrained gen needs xgrammar ({e}): pip install --no-deps xgrammar==0.2.8") from None
        if self.grammars is None:
            self.grammars = GrammarCompiler(self.encoder.hf, self.vocab_size, cache=self.grammar_cache)
        op = cast(Gen, p.op)       # only gen calls are constrained
        c = self.grammars.constraint(op.regex, op.json_schema)
        forced = c.jump_forward() if self.jump_forward else ""
        if forced:
            c.accept_string(forced)
        p.meta["_constraint"], p.meta["forced"] = c, forced

    def _check(self, p: Pending, ids):
        inst = p.owner.instance.id
        if isinstance(p.op, Select):
            ctx, conts = ids
            over = len(ctx) + max(len(c) for c in conts) - self.max_len
            if over > 0:
                if not self.truncate_left:
                    raise UserError(f"instance {inst}: select {p.op.name!r} needs {over + self.max_len} tokens, more "
                                    f"than the model's {self.max_len}-token context; pass --truncate-left to drop "
                                    "its oldest tokens (as lm-eval does)")
                ctx = ctx[over:]
                self.truncated += 1
            return ctx, conts
        if not ids:
            raise UserError(f"instance {inst}: gen {p.op.name!r} has an empty prompt")
        if len(ids) + p.op.max_tokens > self.max_len:
            raise UserError(f"instance {inst}: gen {p.op.name!r} needs {len(ids)} prompt + {p.op.max_tokens} "
                            f"new tokens, more than the model's {self.max_len}-token context")
        return ids

    def _fail(self, p: Pending, message: str) -> None:
        """Before any model work a failing call stops the run; later it ends its own program."""
        run = p.owner
        if self.engine is None:
            raise UserError(message if message.startswith("instance ") else
                            f"instance {run.instance.id}: {message}")
        run.calls.remove(p)
        p.done, p.meta["error"] = True, message       # an empty result: nothing waits on it forever
        run.error = run.error or message
        if not run.finished:
            run.glet.throw(UserError(message))

    # ---- the run --------------------------------------------------------------------------
    def start(self, program: Callable, instances: list[Instance]) -> list[ProgramRun]:
        """Run every program up to its first wait (no model work): the first-stage calls are queued."""
        self.runs = [ProgramRun(k, inst, self) for k, inst in enumerate(instances)]
        for run in self.runs:
            self._start(run, program)
            if run.user_error is not None:
                raise run.user_error
            if run.error is not None:
                raise UserError(f"program failed on instance {run.instance.id}: {run.error}")
        self._tokenize(self.ready)
        return self.runs

    def execute(self, engine: Engine, wave_tokens: int | None = None) -> list[ProgramRun]:
        """Run waves until every program has finished."""
        t0, tokenized = time.perf_counter(), self.tokenize_s
        self.engine = engine
        self.wave_tokens = wave_tokens or engine.pool.num_slots * 3 // 4
        while self.ready:
            wave = self._pick_wave()
            self._execute(wave)
            for run in {p.owner.index: p.owner for p in wave}.values():
                self._resume(run)
        self.stats.execute_s = time.perf_counter() - t0 - self.stats.plan_s - (self.tokenize_s - tokenized)
        t1 = time.perf_counter()
        self._finish_stats()
        self.stats.plan_s += time.perf_counter() - t1
        return self.runs

    def longest_ready(self) -> int:
        """Tokens the longest queued call needs (prompt + new tokens, or context + longest choice)."""
        def need(p: Pending) -> int:
            ids = p.meta["_ids"]
            if isinstance(p.op, Select):
                return len(ids[0]) + max(len(c) for c in ids[1])
            return len(ids) + p.op.max_tokens
        return max((need(p) for p in self.ready), default=1)

    def _start(self, run: ProgramRun, program: Callable) -> None:
        run.state = State(run)

        def body():
            try:
                program(run.state, **run.instance.inputs)
            except UserError as e:  # a call that cannot run (e.g. too long): named with its instance
                run.error, run.user_error = str(e), e
            except Exception as e:  # a program's own bug: kept with its instance
                run.error = f"{type(e).__name__}: {e}"
            self._done(run)
        run.glet = greenlet.greenlet(body, parent=self.hub)
        run.glet.switch()

    def _resume(self, run: ProgramRun) -> None:
        if not run.finished and all(p.done for p in run.calls):
            cast(greenlet.greenlet, run.glet).switch()     # not finished: it has a greenlet

    def _done(self, run: ProgramRun) -> None:
        self.max_final_footprint = max(self.max_final_footprint, run.footprint)
        if self.progress:
            self.progress(run.index, self.stats)

    def _pick_wave(self) -> list[Pending]:
        """Every queued select; the generation calls of programs already under way; and calls of
        programs not yet started while the estimated cache footprint of all started, unfinished
        programs stays within `wave_tokens` (half the pool), so a program's KV is still cached
        when its next stage comes."""
        self._tokenize([p for p in self.ready if "_ids" not in p.meta])
        ready, self.ready = [p for p in self.ready if "_ids" in p.meta], []
        wave = [p for p in ready if isinstance(p.op, Select)]
        gens = [p for p in ready if isinstance(p.op, Gen)]
        tree = cast("Engine", self.engine).tree     # set by execute(), the only caller
        matched = {id(p): tree.match_len(p.meta["_ids"]) if tree else 0 for p in gens}
        if self.schedule == "dfs":      # longest cached prefix first, then radix-tree (sorted) order
            gens.sort(key=lambda p: (-matched[id(p)], p.meta["_ids"]))
        elif self.schedule == "random":
            random.Random(self.seed + self.waves).shuffle(gens)
        wave += [p for p in gens if p.owner.started]
        active = [r for r in self.runs if r.started and not r.finished]
        live = sum(r.footprint for r in active)
        grown = self.max_final_footprint or 4 * max((r.footprint for r in active), default=0)
        admitted: set[int] = set()
        for p in gens:
            if p.owner.started:
                continue
            if p.owner.index not in admitted:
                cost = max(grown, len(p.meta["_ids"]) - matched[id(p)] + cast(Gen, p.op).max_tokens)
                if (wave or admitted) and live + cost > self.wave_tokens:
                    self.ready.append(p)
                    continue
                admitted.add(p.owner.index)
                live += cost
            wave.append(p)
        for p in wave:
            p.owner.started = True
        return wave

    def first_requests(self) -> list[ScoreRequest | GenerateRequest]:
        """The engine requests of every queued call (after `start`: the whole first stage), as the
        first wave would run them if it held them all: what a dry run plans."""
        return self._requests(self.ready)[0]

    def _requests(self, wave: list[Pending]) -> tuple[list[ScoreRequest | GenerateRequest], list[Pending]]:
        requests: list[ScoreRequest | GenerateRequest] = []
        owner: list[Pending] = []
        for p in wave:
            if isinstance(p.op, Select):
                ctx, conts = p.meta["_ids"]
                for c in conts:
                    requests.append(ScoreRequest(ctx, c))
                    owner.append(p)
            else:
                op = p.op
                seed = hash((self.seed, p.owner.index, p.seq)) & 0x7FFFFFFF
                params = SamplingParams(op.max_tokens, op.temperature, op.top_p, seed, op.stop)
                requests.append(GenerateRequest(p.meta["_ids"], params, p.meta.get("_constraint")))
                owner.append(p)
        return requests, owner

    def plan_ahead(self) -> None:
        """Plan the first wave before the model is there (the runner calls this while it loads), when
        that wave is known without the engine: every queued call a select (a wave of generation
        calls depends on the engine's cache and pool)."""
        if self.waves or not self.ready or not all(isinstance(p.op, Select) for p in self.ready):
            return
        t = time.perf_counter()
        requests = self._requests(self.ready)[0]
        self._ahead = (list(self.ready), plan_requests(requests, self.schedule, self.seed))
        self.stats.plan_s += time.perf_counter() - t

    def _execute(self, wave: list[Pending]) -> None:
        requests, owner = self._requests(wave)
        for p in wave:
            p.meta.pop("_constraint", None)
        ahead, self._ahead = self._ahead, None
        same = ahead is not None and len(ahead[0]) == len(wave) and all(map(operator.is_, ahead[0], wave))
        plan = ahead[1] if ahead is not None and same else None
        engine = cast("Engine", self.engine)     # set by execute(), the only caller
        results, st = engine.run(requests, schedule=self.schedule, seed=self.seed + self.waves, plan=plan)
        self._account(requests, owner, results, st)
        k = 0
        for p in wave:
            n = len(p.op.choices) if isinstance(p.op, Select) else 1
            self._resolve(p, results[k:k + n])
            k += n
        self.waves += 1

    def _resolve(self, p: Pending, results) -> None:
        ids = p.meta.pop("_ids")
        if isinstance(p.op, Select):
            logprobs = [r.logprob for r in results]
            best = max(range(len(logprobs)), key=logprobs.__getitem__)
            p.value = p.op.choices[best]
            p.meta.update(index=best, logprobs=logprobs, is_greedy=[r.is_greedy for r in results],
                          num_tokens=[r.num_tokens for r in results])
        else:
            r = results[0]
            p.value = p.meta.get("forced", "") + r.text
            p.meta.update(finish_reason=r.finish_reason, prompt_tokens=len(ids), output_tokens=len(r.token_ids),
                          steps=r.steps, jumped_tokens=r.jumped_tokens)
            if r.grammar_complete is not None:     # a constrained gen cut short is marked, never accepted
                p.meta["incomplete"] = not r.grammar_complete
        p.done = True

    # ---- counts ---------------------------------------------------------------------------
    def _account(self, requests, owner, results, st: RunStats) -> None:
        total = self.stats
        for name in ("requests", "executed", "prompt_tokens", "cached_tokens", "computed_tokens", "decode_tokens",
                     "forward_batches", "evicted_tokens", "masked_rows", "resampled_rows"):
            setattr(total, name, getattr(total, name) + getattr(st, name))
        total.plan_s += st.plan_s
        for p in dict.fromkeys(owner):
            c = self.stages.setdefault(p.stage, StageCounts())
            c.calls += 1
        first: dict[int, int] = {}
        for k, p in enumerate(owner):
            first.setdefault(id(p), k)
        for j in st.order:
            p, r = owner[j], results[j]
            decode = getattr(r, "decode_tokens", 0)
            for c in (self.stages[p.stage], p.owner.tokens):
                c.requests += len(st.members[j])
                c.prompt_tokens += r.prompt_tokens
                c.cached_tokens += r.cached_tokens
                c.computed_tokens += r.computed_tokens
                c.decode_tokens += decode
            self._prompts.append(requests[j].prompt)
            if isinstance(p.op, Gen):
                self._generated.append((requests[j].prompt + r.token_ids[:-1], len(requests[j].prompt)))
            choices = [m - first[id(p)] for m in st.members[j]]
            self.request_rows.append(dict(
                order=len(self.request_rows), wave=self.waves, instance_id=p.owner.instance.id, stage=p.stage,
                call=p.op.name, kind="select" if isinstance(p.op, Select) else "gen",
                choices=choices if isinstance(p.op, Select) else [], prompt_tokens=r.prompt_tokens,
                cached_tokens=r.cached_tokens, computed_tokens=r.computed_tokens, decode_tokens=decode,
                token_ids=requests[j].prompt))

    def _finish_stats(self) -> None:
        """The post-hoc optimum: from the tree of every prompt actually executed, where tokens that
        generation already put in the cache count as free (their KV exists without any prefill)."""
        s = self.stats
        plain = summarize(self._prompts).unique_tokens     # the prompts' own tree (Theorem 3.1)
        s.unique_tokens = posthoc_unique(self._prompts, self._generated) if self._generated else plain
        s.optimal_hit_rate = 1 - s.unique_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
        s.engine_optimal_hit_rate = s.optimal_hit_rate
        self.prompt_tree_optimal_hit_rate = 1 - plain / s.prompt_tokens if s.prompt_tokens else 0.0
