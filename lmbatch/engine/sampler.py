"""The next token of each running request: sampling within its grammar, jump-forward over the text
its grammar forces, and whether the request is done.

Masking only removes candidates and the sampling noise is fixed per (seed, step, token), so a
grammar row's pick is the same whether its mask is applied before sampling or only after its grammar
rejected the unconstrained pick. When a grammar row's token mask is filled (`masks`): "overlap"
before sampling while the device computes the logits (else only if the grammar rejects the row's
unconstrained pick), "lazy" only on rejection, "eager" always before sampling. The three pick the
same tokens.
"""
from __future__ import annotations

from itertools import repeat
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, cast

import numpy as np
import torch

from lmbatch.attention.base import to_device
from lmbatch.engine.options import MASK_MODES
from lmbatch.engine.sampling import sample, sample_on_device
from lmbatch.engine.state import Running
from lmbatch.model.config import ModelConfig
from lmbatch.model.tokenizer import LazyTokenizer

if TYPE_CHECKING:      # lmbatch.grammar imports xgrammar: loaded only where a grammar is used
    from lmbatch.grammar import Constraint

STOP_MARGIN = 4     # tokens decoded before a stop string's longest reach (see Sampler._stop_in_tail)
AHEAD_ROWS = 4      # masks filled between two looks at the device (one by one: a batched fill overshoots)


class Launched(NamedTuple):
    """Tokens sampled on the device for `rows`, on their way to the host (`done` says they are there)."""
    rows: list[Running]
    tokens: torch.Tensor        # on the device, a row each
    host: torch.Tensor          # the same, copied into pinned memory
    done: torch.cuda.Event
    watch: np.ndarray | None    # per token id: whether it needs `_append`'s checks (`Sampler._watch`)


class Picked(NamedTuple):
    masked: int         # grammar rows that filled a token mask
    resampled: int      # of those, rows masked after their pick was rejected (a second round)


def _constraints(rows: list[Running], ks: list[int]) -> list[Constraint]:
    return cast("list[Constraint]", [rows[k].constraint for k in ks])


class Sampler:
    def __init__(self, cfg: ModelConfig, device: torch.device, *, tokenizer: Any = None, masks: str = "overlap",
                 jump_forward: bool = True, max_rows: int = 256):
        if masks not in MASK_MODES:
            raise ValueError(f"masks must be one of {MASK_MODES}, not {masks!r}")
        self.cfg, self.device, self.tokenizer = cfg, device, tokenizer
        self.masks, self.jump_forward, self.max_rows = masks, jump_forward, max_rows
        self._mask_buf: torch.Tensor | None = None
        self._retok_memo: dict = {}     # retokenized jump boundaries (the tokenizer never changes)
        self._stop_memo: dict[tuple[str, ...], frozenset[int] | None] = {}
        self._watch_memo: dict[frozenset[tuple[str, ...]], np.ndarray | None] = {}
        self._host_buf: torch.Tensor | None = None     # pinned: launched tokens on their way to the host

    def pick(self, rows: list[Running], logits: torch.Tensor) -> Picked:
        """Pick each row's next token (within its grammar, if it has one) and append it.

        Rows masked ahead (`_mask_ahead`) sample once; every other grammar row first takes its
        unconstrained pick, and only the rejected ones fill a mask and pick again (a second round on
        the device)."""
        grammar = [k for k, r in enumerate(rows) if r.constraint is not None and not r.thinking]
        ahead = self._mask_ahead(rows, grammar, logits) if grammar else []
        tokens = sample(logits, [r.params for r in rows], [r.steps for r in rows])
        # lmbatch.grammar imports xgrammar and transformers (seconds): only where a row has a grammar
        redo = self._redo_rejected(rows, grammar, logits, tokens) if grammar else []
        for r, t in zip(rows, tokens):
            r.steps += 1
            self._append(r, t)
        return Picked(len(ahead) + len(redo), len(redo))

    def _redo_rejected(self, rows: list[Running], grammar: list[int], logits: torch.Tensor,
                       tokens: list[int]) -> list[int]:
        """The grammar rows whose pick their grammar rejected, picked again within their masks (in `tokens`)."""
        from lmbatch.grammar import accept_tokens
        ok = accept_tokens(_constraints(rows, grammar), [tokens[k] for k in grammar])
        redo = [k for k, a in zip(grammar, ok) if not a]
        for k, a in zip(grammar, ok):
            rows[k].rejected = not a
        if redo:
            from lmbatch.grammar import apply_mask, fill_masks
            bitmask = self._mask_rows(len(redo))[:len(redo)]
            fill_masks(_constraints(rows, redo), bitmask)
            sub = logits[to_device(torch.tensor(redo), logits.device)]
            apply_mask(sub, bitmask)
            picked = sample(sub, [rows[k].params for k in redo], [rows[k].steps for k in redo])
            accept_tokens(_constraints(rows, redo), picked)
            for k, t in zip(redo, picked):
                tokens[k] = t
        return redo

    def launch(self, rows: list[Running], logits: torch.Tensor) -> Launched:
        """Sample each row's next token on the device and start its copy to the host, waiting for nothing:
        the tokens feed the next step on the device (`Running.pending`) and reach the rows at `land`.
        For rows without a grammar or thinking (`plain`), on CUDA."""
        tokens = sample_on_device(logits, [r.params for r in rows], [r.steps for r in rows])
        if self._host_buf is None or len(self._host_buf) < len(rows):
            self._host_buf = torch.empty(max(len(rows), 2 * self.max_rows), dtype=torch.int64).pin_memory()
        host = self._host_buf[:len(rows)]
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        for k, r in enumerate(rows):
            r.pending, r.pending_src = 1, k
        return Launched(rows, tokens, host, done, self._watch(rows, logits.shape[-1]))

    def land(self, launched: Launched) -> None:
        """Append a launch's tokens to its rows (those that ended meanwhile drop theirs). The host buffer is
        free again once this returns: the next launch may reuse it.

        A token that is no EOS id and cannot end one of the launch's stop strings (`_watch`) can only end its
        row by the length limit: it skips `_append`'s other checks (a plain row has no grammar or thinking),
        and its row's stop-string search moves past it as `_stop_in_tail` would have."""
        launched.done.synchronize()
        watch = launched.watch
        looks = repeat(True) if watch is None else watch[launched.host.numpy()].tolist()
        for r, t, look in zip(launched.rows, launched.host.tolist(), looks):
            r.pending = 0
            if r.finish:
                continue
            r.steps += 1
            if look:
                self._append(r, t)
                continue
            out = r.out
            out.append(t)
            r.stop_seen = len(out)
            if len(out) >= r.params.max_new_tokens:
                r.finish = "length"

    def _watch(self, rows: list[Running], vocab: int) -> np.ndarray | None:
        """For plain rows (`plain`): a bool per token id (`vocab` of them), true for EOS ids and for the
        tokens that may end one of the rows' stop strings (`_stop_tokens`); None where a stop string's
        tokens cannot be told (every token is then checked in full)."""
        stops = frozenset(r.params.stop for r in rows)
        if stops not in self._watch_memo:
            helds = [self._stop_tokens(stop) if stop else frozenset()
                     for stop in (stops if self.tokenizer is not None else ())]
            self._watch_memo[stops] = _token_mask(vocab, [self.cfg.eos_token_ids, *helds])
        return self._watch_memo[stops]

    @staticmethod
    def plain(r: Running) -> bool:
        """Whether a row's next input is its sampled token whatever it is (no grammar to check it, no
        thinking marker to append after it): its step can start before the host sees the token."""
        return r.constraint is None and not r.params.think_end

    def _mask_ahead(self, rows: list[Running], grammar: list[int], logits: torch.Tensor) -> list[int]:
        """Fill and apply the token masks of grammar rows before their first pick; returns those rows.

        Always the rows whose top-p nucleus depends on the mask, and every row with `masks="eager"`.
        With `masks="overlap"`, also as many rows as the host fills while the device is still
        computing `logits` (time it would otherwise spend waiting), those whose pick was rejected at
        their last step first: they skip the second round their rejection would cost."""
        from lmbatch.grammar import apply_mask, fill_masks
        must = [k for k in grammar if self.masks == "eager" or rows[k].params.top_p < 1.0]
        rest = [k for k in grammar if self.masks == "overlap" and rows[k].params.top_p >= 1.0]
        busy = _device_busy(logits) if rest else None
        if not must and busy is None:
            return []
        bitmask = self._mask_rows(len(rows))
        if must:
            fill_masks(_constraints(rows, must), bitmask, must)
        ahead = list(must)
        if busy is not None:
            rest.sort(key=lambda k: not rows[k].rejected)
            i = 0
            while i < len(rest) and busy():
                chunk = rest[i:i + AHEAD_ROWS]
                fill_masks(_constraints(rows, chunk), bitmask, chunk)
                ahead += chunk
                i += len(chunk)
        if ahead:
            apply_mask(logits, bitmask[:len(rows)], rows=ahead)
        return ahead

    def _mask_rows(self, n: int) -> torch.Tensor:
        """A CPU bitmask of at least n rows, reused across steps (pinned: it goes to the device
        without a blocking copy; it is written only after a sampling sync has waited for the last one)."""
        from lmbatch.grammar import allocate_bitmask
        if self._mask_buf is None or len(self._mask_buf) < n:
            buf = allocate_bitmask(max(n, 2 * self.max_rows), self.cfg.vocab_size)
            self._mask_buf = buf.pin_memory() if self.device.type == "cuda" else buf
        return self._mask_buf

    def _append(self, r: Running, token: int) -> None:
        """Add a sampled token (its grammar has accepted it) and see whether the request is done."""
        r.out.append(token)
        p = r.params
        if not p.ignore_eos and token in self.cfg.eos_token_ids:
            r.finish = "eos"
        elif r.thinking:
            self._think(r)
        elif r.constraint is not None and token in r.constraint.stops and r.constraint.is_terminated():
            r.finish = "eos"                                            # the grammar's own stop token
        elif p.stop and self.tokenizer is not None and self._stop_in_tail(r):
            r.finish = "stop"
        elif len(r.out) - r.think_len >= p.max_new_tokens:
            r.finish = "length"
        elif r.constraint is not None and self.jump_forward:
            self._jump(r)

    def _stop_in_tail(self, r: Running) -> bool:
        """Whether a stop string appears in the answer's text, decoding only its tail: the tokens added
        since the last search and, before them, as many tokens as the longest stop string has UTF-8
        bytes plus STOP_MARGIN (every token is at least one byte of text, and the margin covers what
        decoding a cut sequence changes at its start: a split character, a stripped leading space).
        An occurrence the last search did not see ends among the new tokens, so it lies in that tail:
        the same step ends as with the whole answer decoded each step, at a cost that does not grow
        with the output."""
        stop = r.params.stop
        holding = self._stop_tokens(stop)
        if holding is not None and holding.isdisjoint(r.out[r.stop_seen:]):
            r.stop_seen = len(r.out)    # no new token holds a stop string's last character: none ends in them
            return False
        lo = max(r.think_len, min(r.stop_seen, len(r.out) - 1) - max(len(s.encode()) for s in stop) - STOP_MARGIN)
        r.stop_seen = len(r.out)
        text = self.tokenizer.decode(r.out[lo:])
        return any(s in text for s in stop)

    def _stop_tokens(self, stop: tuple[str, ...]) -> frozenset[int] | None:
        """The tokens a new occurrence of one of `stop` must end in (`TextDecoder.tokens_holding`: those
        whose text holds a stop string's last character), or None where lmbatch's decoder cannot say
        (a transformers tokenizer, or such a character): every search then decodes."""
        if stop not in self._stop_memo:
            decoder = self.tokenizer.decoder() if isinstance(self.tokenizer, LazyTokenizer) else None
            self._stop_memo[stop] = None if decoder is None or not all(stop) else \
                decoder.tokens_holding(frozenset(s[-1] for s in stop))
        return self._stop_memo[stop]

    def _think(self, r: Running) -> None:
        """A thinking row's token: the thinking ends where its output ends with the end marker, or the
        marker is appended once the thinking budget is spent; the answer (constrained) follows."""
        end = r.params.think_end
        if tuple(r.out[-len(end):]) == end:
            r.think_start = len(r.out) - len(end)
        elif len(r.out) >= r.params.think_budget:
            r.think_start = len(r.out)
            r.out += end            # fed with the next step, as jump-forward text is
            r.jumped += len(end)
        else:
            return
        r.thinking, r.think_len = False, len(r.out)
        if r.constraint is not None and self.jump_forward:
            self._jump(r)           # the text the grammar forces at its start

    def _jump(self, r: Running) -> None:
        """Append the text the grammar forces, retokenized at the boundary, without decoding it; and
        end the output there if the grammar then admits nothing but its stop token."""
        c = cast("Constraint", r.constraint)    # _append jumps only rows with a grammar
        forced = c.jump_forward()
        if forced:          # most steps force nothing: checked before any other work, for every grammar row
            from lmbatch.grammar import retokenize_jump

            # the answer's tokens only: the boundary never reaches into the thinking or its marker
            new, n = retokenize_jump(self.tokenizer, c, r.out[r.think_len:], forced, memo=self._retok_memo)
            if new or n:
                r.fed = min(r.fed, len(r.out) - n)
                r.out = r.out[:len(r.out) - n] + new
                r.jumped += len(new)
                if len(r.out) - r.think_len >= r.params.max_new_tokens:
                    r.out, r.finish = r.out[:r.think_len + r.params.max_new_tokens], "length"
                    return
        stop = c.forced_stop()
        if stop is not None and c.accept(stop):     # the stop token would be the only pick
            r.out.append(stop)
            r.jumped += 1
            r.finish = "eos"

    def text(self, r: Running) -> str | None:
        """The output's text (the answer, after any thinking): without the stop token it ended on, cut
        before the stop string it ended at."""
        if self.tokenizer is None:
            return None
        if r.thinking:              # ended before its thinking did: no answer
            return ""
        out = r.out[r.think_len:]
        text = self.tokenizer.decode(out[:-1] if r.finish == "eos" and out else out)
        if r.finish == "stop":
            text = text[:min(text.find(s) for s in r.params.stop if s in text)]
        return text

    def thinking(self, r: Running) -> str | None:
        """The thinking's text, without its end marker (None: the request did not think)."""
        if not r.params.think_end or self.tokenizer is None:
            return None
        out = r.out if r.thinking else r.out[:r.think_start]
        return self.tokenizer.decode(out[:-1] if r.thinking and r.finish == "eos" else out)


def _token_mask(vocab: int, sets: list) -> np.ndarray | None:
    """A bool per token id below `vocab`, true for the ids in any of `sets`; None if one of them is None."""
    if any(ids is None for ids in sets):
        return None
    mask = np.zeros(vocab, dtype=bool)
    for ids in sets:
        mask[[t for t in ids if t < vocab]] = True
    return mask


def _device_busy(logits: torch.Tensor) -> Callable[[], bool] | None:
    """A probe: is the device still computing `logits`? None where the host cannot overlap it."""
    if logits.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return lambda: not event.query()
