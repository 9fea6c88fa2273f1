"""What a user watches while the model works: the tokens of model work done of those planned so far, prompt
tokens computed and tokens decoded (each wave's plan adds its unique prompt tokens and its generations' most
tokens, a generation that ends early gives back what it did not use), their rate, the hit rate and tokens
decoded, so progress is told from a hang. Fed by the engine's callback: as each request is done and, while
generations run, between decode steps."""
from __future__ import annotations

import time
from typing import Any, NamedTuple

REDRAW_S = 0.1


class Meter(NamedTuple):
    """A bar's counts: tokens of model work done and planned, prompt tokens cached and computed, tokens decoded."""
    done: int
    total: int
    cached: int
    computed: int
    decoded: int


class TokenProgress:
    """The engine's progress callback (`progress(i, stats)`: a request needs nothing more, or, i = -1, a decode
    step's tokens; `stats` are its run's counts so far). A run of several waves (multi-stage programs) is
    several engine runs, each with counts of its own: a new one starts when other counts arrive."""

    def __init__(self, desc: str = "execute", disable: bool = False):
        from tqdm import tqdm

        self.bar = tqdm(total=0, unit="tok", unit_scale=True, desc=desc, dynamic_ncols=True, disable=disable)
        self.computed = self.cached = self.decoded = 0      # of the engine runs done
        self.n = 0                                          # prompt tokens computed and tokens decoded so far
        self._run: Any = None                               # the counts of the engine run under way
        self._redraw = 0.0

    def __call__(self, i: int, stats: Any) -> None:
        """Keeps the counts, and draws at most every REDRAW_S."""
        if stats is not self._run:
            self._fold()
            self._run = stats
        decoded = stats.decode_tokens + stats.decoding_tokens
        done = self.n = self.computed + self.decoded + stats.computed_tokens + decoded
        self.bar.total = (self.computed + self.decoded + max(stats.unique_tokens, stats.computed_tokens)
                          + max(stats.decode_budget, decoded))
        now = time.monotonic()
        if now < self._redraw:
            return
        self._redraw = now + REDRAW_S
        self._postfix(self.cached + stats.cached_tokens, self.computed + stats.computed_tokens, self.decoded + decoded)
        self.bar.update(done - self.bar.n)

    def counts(self) -> Meter:
        """What the bar shows now, the engine run under way included."""
        s, cached, computed, decoded = self._run, self.cached, self.computed, self.decoded
        if s is not None:
            cached, computed = cached + s.cached_tokens, computed + s.computed_tokens
            decoded += s.decode_tokens + s.decoding_tokens
        return Meter(self.n, int(self.bar.total or 0), cached, computed, decoded)

    def show(self, meters: list[Meter]) -> None:
        """Draw the sums of several runs' counts (each a data-parallel worker's, running programs of its own)."""
        n, total, cached, computed, decoded = (sum(col) for col in zip(*meters)) if meters else (0,) * 5
        self.bar.total = max(total, n)
        self._postfix(cached, computed, decoded)
        self.bar.update(n - self.bar.n)

    def _postfix(self, cached: int, computed: int, decoded: int) -> None:
        post = {"hit": f"{cached / max(cached + computed, 1):.4f}"} | ({"decoded": decoded} if decoded else {})
        self.bar.set_postfix(post, refresh=False)    # tqdm's own rate is the computed tokens/s

    def _fold(self) -> None:
        """An engine run ended: its counts join the totals (it computed less than its plan's unique
        tokens where an earlier wave had cached a prefix, and decoded less than its most tokens where
        generations ended early)."""
        s, self._run = self._run, None
        if s is None:
            return
        self.computed += s.computed_tokens
        self.cached += s.cached_tokens
        self.decoded += s.decode_tokens
        self.n = self.bar.total = self.computed + self.decoded
        self._postfix(self.cached, self.computed, self.decoded)     # a run's last counts, drawn or not yet
        self.bar.update(self.n - self.bar.n)

    def close(self) -> None:
        self._fold()
        self.bar.close()
