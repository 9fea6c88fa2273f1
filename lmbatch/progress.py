"""What a user watches while the model works: prompt tokens computed of those planned so far (each
wave's plan adds its unique tokens), their rate, the hit rate and tokens decoded, so progress is told
from a hang.
Fed by the engine's per-request callback; a run of several waves (multi-stage programs) calls
`wave_done` after each."""
from __future__ import annotations

from typing import Any


class TokenProgress:
    def __init__(self, desc: str = "execute", disable: bool = False):
        from tqdm import tqdm

        self.bar = tqdm(total=0, unit="tok", unit_scale=True, desc=desc, dynamic_ncols=True, disable=disable)
        self.total = self.computed = self.cached = self.decoded = 0     # of the waves done
        self.n = 0                                                      # computed so far

    def __call__(self, i: int, stats: Any) -> None:
        """The engine's progress callback (a request needs nothing more); `stats` is its run's so far."""
        done = self.computed + stats.computed_tokens
        self.n, self.bar.total = done, max(self.total + stats.unique_tokens, done)
        cached, decoded = self.cached + stats.cached_tokens, self.decoded + stats.decode_tokens
        post = {"hit": f"{cached / max(cached + done, 1):.4f}"} | ({"decoded": decoded} if decoded else {})
        self.bar.set_postfix(post, refresh=False)    # tqdm's own rate is the computed tokens/s
        self.bar.update(done - self.bar.n)          # redraws at most every 0.1 s (disabled: nothing)

    def wave_done(self, stats: Any) -> None:
        self.total += stats.computed_tokens         # what it took (a prefix cached by an earlier wave: less)
        self.computed += stats.computed_tokens
        self.cached += stats.cached_tokens
        self.decoded += stats.decode_tokens
        self.n, self.bar.total = self.computed, max(self.total, self.computed)
        self.bar.update(self.computed - self.bar.n)

    def close(self) -> None:
        self.bar.close()
