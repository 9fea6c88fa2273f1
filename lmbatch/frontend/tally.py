"""The interpreter's counts: run totals, per stage and per program, one row per executed request,
and the post-hoc optimum of the prompts actually executed."""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from lmbatch.frontend.calls import EngineRequest
from lmbatch.frontend.dsl import Gen, Pending, Select
from lmbatch.requests import GenerateResult, RunStats, ScoreResult, TokenCounts, optimal_hit_rate
from lmbatch.rundir.rows import RequestRow
from lmbatch.scheduler.merge import merge_sorted
from lmbatch.scheduler.planner import (
    posthoc_figures,
    posthoc_seqs,
    posthoc_unique,
    sorted_lcps,
    sub_lcps,
    summarize,
)


@dataclass
class StageCounts(TokenCounts):
    calls: int = 0
    requests: int = 0               # engine requests (a select has one per choice)


class Tally:
    def __init__(self) -> None:
        self.stats = RunStats()
        self.stages: dict[int, StageCounts] = {}
        self.requests_accounted = 0
        self.think_tokens = 0           # of generated tokens, those of thinking and its end marker
        self.rows_by_run: dict[int, list[RequestRow]] = {}   # one row per executed request, by ProgramRun.index
        self._first: dict[int, int] = {}                # id(call) -> its first engine request in the wave
        self.prompt_tree_optimal_hit_rate = 0.0
        self._prompts: list[list[int]] = []            # executed prompts, for the post-hoc optimum
        self._generated: list[tuple[list[int], int]] = []  # (prompt + fed output, prompt length)
        # batches of requests the engine ran (a wave, or each batch that joined an open stream), and the
        # unique tokens of the first's plan: the optimum of a run of one batch without generation
        self.batches = 0
        self.first_unique = 0
        # by task (a suite has several): token counts, and the task's own optimum (`finish`)
        self.tasks: dict[str, TokenCounts] = {}
        self.task_unique: dict[str, int] = {}
        self._prompt_tasks: list[str] = []                 # the task of each of _prompts
        self._generated_tasks: list[str] = []
        # the first wave's requests in sorted order with their common prefixes, lengths and tasks, where
        # its plan was made: each task's tree from them, not from its prompts sorted again
        self._tree: tuple[Sequence[int], np.ndarray, list[int], list[str]] | None = None
        # every sequence of the post-hoc optimum in sorted order with its common prefixes (`finish`, where
        # there was generation), and, absorbed, each other tally's: (its first prompt here, its first
        # generation here, its prompts, its sorted order), merged in `finish` rather than sorted again
        # (None: sorted again, as where this tally had prompts of its own or another had no sorted order)
        self.sorted: tuple[list[int], np.ndarray] | None = None
        self._parts: list[tuple[int, int, int, tuple[list[int], np.ndarray]]] | None = []

    def start_wave(self, owner: list[Pending],
                   tree: tuple[Sequence[int], np.ndarray, list[int]] | None = None) -> None:
        """Count a wave's calls (`owner[j]` is the call of its engine request j). `tree`: the first wave's
        requests' sorted order and common prefixes (its plan's) and their prompts' lengths."""
        if tree is not None and not self.batches:
            self._tree = (*tree, [p.owner.instance.task for p in owner])
        self._first = {}
        self.join(owner, 0)

    def join(self, owner: list[Pending], first: int) -> None:
        """Count calls that joined the running wave (an open stream), their engine requests numbered
        from `first`."""
        for p in dict.fromkeys(owner):
            self.stages.setdefault(p.stage, StageCounts()).calls += 1
        for k, p in enumerate(owner, first):
            self._first.setdefault(id(p), k)      # a select's first choice's request

    def account(self, requests: list[EngineRequest], owner: list[Pending],
                results: Sequence[ScoreResult | GenerateResult], executed: Sequence[int],
                members: dict[int, list[int]], wave: Sequence[int]) -> None:
        """Count executed engine requests of a wave whose results are final, in the order given
        (their execution order, or the order they finished in when handed over during the wave);
        `wave[j]`: the batch request j entered the engine in."""
        first = self._first
        for j in executed:
            p, r = owner[j], results[j]
            stage = self.stages[p.stage]
            stage.requests += len(members[j])
            stage.add(r)
            p.owner.tokens.add(r)
            task = p.owner.instance.task
            self.tasks.setdefault(task, TokenCounts()).add(r)
            prompt = requests[j].prompt
            self._prompts.append(prompt)
            self._prompt_tasks.append(task)
            if isinstance(r, GenerateResult) and isinstance(p.op, Gen):
                self._generated.append((prompt + r.token_ids[:-1], len(prompt)))
                self._generated_tasks.append(task)
                self.think_tokens += r.think_tokens
            select = isinstance(p.op, Select)
            row = RequestRow(
                order=self.requests_accounted, wave=wave[j], instance_id=p.owner.instance.id, task=task, stage=p.stage,
                call=p.op.name, kind="select" if select else "gen",
                choices=[m - first[id(p)] for m in members[j]] if select else [], prompt_tokens=r.prompt_tokens,
                cached_tokens=r.cached_tokens, computed_tokens=r.computed_tokens, decode_tokens=r.decode_tokens,
                token_ids=prompt)
            self.requests_accounted += 1
            self.rows_by_run.setdefault(p.owner.index, []).append(row)

    def end_wave(self, st: RunStats, batches: int = 1) -> None:
        """Add a wave's engine run to the totals (`batches`: of requests that entered it)."""
        self.stats.add_run(st)
        self.stats.plan_s += st.plan_s
        if not self.batches:
            self.first_unique = st.unique_tokens
        self.batches += batches

    def absorb(self, other: Tally) -> None:
        """Add another interpreter's counts, each of its waves and the prompts it executed (a data-parallel
        worker's, which ran programs of this run's): `finish` then gives the optimum of every prompt of both.
        Its request rows are its own (written as its programs finished)."""
        self.stats.add_run(other.stats)
        for k, c in other.stages.items():
            mine = self.stages.setdefault(k, StageCounts())
            mine.add(c)
            mine.calls += c.calls
            mine.requests += c.requests
        for task, t in other.tasks.items():
            self.tasks.setdefault(task, TokenCounts()).add(t)
        self.think_tokens += other.think_tokens
        self.requests_accounted += other.requests_accounted
        if self._parts is not None and (self._parts or not self._prompts) and other.sorted is not None \
                and other._generated:
            self._parts.append((len(self._prompts), len(self._generated), len(other._prompts), other.sorted))
        else:
            self._parts = None
        self._prompts += other._prompts
        self._prompt_tasks += other._prompt_tasks
        self._generated += other._generated
        self._generated_tasks += other._generated_tasks
        if not self.batches:
            self.first_unique = other.first_unique
        self.batches += other.batches
        self._tree = None           # no one wave's plan holds every request

    def finish(self) -> None:
        """The post-hoc optimum: from the tree of every prompt actually executed, where tokens that
        generation already put in the cache count as free (their KV exists without any prefill). A run
        of one wave without generation has it already: its batch's tree is that tree (an engine reports
        the whole batch's, however many workers ran it). Made with Python's cycle collector paused: the tree's
        nodes it builds set off its passes over every token list the run holds (tree of thought's optimum from
        4 workers' tallies: 1.07 s with it, 0.25 s without; benchmarks/bench_posthoc_merge.py)."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            self._finish()
        finally:
            if enabled:
                gc.enable()

    def _finish(self) -> None:
        s = self.stats
        if self._generated:         # one sort gives both: the post-hoc optimum, the prompts' own tree's
            seqs = posthoc_seqs(self._prompts, self._generated)
            self.sorted = self._merged(seqs) or sorted_lcps(seqs)
            s.unique_tokens, plain = posthoc_figures(self._prompts, self._generated, self.sorted)
        else:
            plain = self.first_unique if self.batches == 1 else summarize(self._prompts).unique_tokens
            s.unique_tokens = plain     # the prompts' own tree (Theorem 3.1)
        s.optimal_hit_rate = optimal_hit_rate(s.unique_tokens, s.prompt_tokens)
        s.engine_optimal_hit_rate = s.optimal_hit_rate
        self.prompt_tree_optimal_hit_rate = optimal_hit_rate(plain, s.prompt_tokens)
        self._finish_tasks()

    def _merged(self, seqs: list[list[int]]) -> tuple[list[int], np.ndarray] | None:
        """The sorted order of `seqs` merged from the absorbed tallies' own (None: not each had one)."""
        parts = self._parts
        if not parts:
            return None
        total = len(self._prompts)
        mapped = []
        for first_prompt, first_generation, prompts, (order, lcps) in parts:
            at = np.asarray(order, dtype=np.int64)
            at = np.where(at < prompts, first_prompt + at, total + first_generation + at - prompts)
            mapped.append((at.tolist(), lcps))
        return merge_sorted(seqs, mapped)

    def _finish_tasks(self) -> None:
        """Each task's own optimum: the unique tokens of its prompts alone (as the run's, post hoc). A
        task of a suite computes at most these (its prefixes shared with another task cost it less)."""
        if len(self.tasks) == 1:
            self.task_unique = {task: self.stats.unique_tokens for task in self.tasks}
            return
        if self.batches == 1 and not self._generated and self._tree is not None:
            self._tasks_from_tree(*self._tree)
            return
        for task in self.tasks:
            prompts = [q for q, t in zip(self._prompts, self._prompt_tasks) if t == task]
            generated = [g for g, t in zip(self._generated, self._generated_tasks) if t == task]
            self.task_unique[task] = posthoc_unique(prompts, generated) if generated else \
                summarize(prompts).unique_tokens

    def _tasks_from_tree(self, order: Sequence[int], lcps: np.ndarray, lens: list[int], tasks: list[str]) -> None:
        """Each task's tree, from the one wave's sorted order: its requests' places in it and the least
        common prefix between each two of them (nothing sorted again)."""
        names = sorted(set(tasks))
        at = np.asarray(order, dtype=np.int64)
        code = np.searchsorted(np.asarray(names, dtype=object), np.asarray(tasks, dtype=object))[at]
        length = np.asarray(lens, dtype=np.int64)[at]
        for k, task in enumerate(names):
            ranks = np.flatnonzero(code == k)
            self.task_unique[task] = int((length[ranks] - sub_lcps(lcps, ranks)).sum())
