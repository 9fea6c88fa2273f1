"""A call's way through the interpreter: its token ids (checked against the model's context, with
its grammar compiled for a constrained gen), the engine requests it becomes, and its result."""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Sequence, TypeAlias, cast

from lmbatch.errors import UserError
from lmbatch.frontend.dsl import CallIds, Gen, Pending, Select, SelectIds
from lmbatch.frontend.tokenize import TextEncoder
from lmbatch.requests import GenerateRequest, GenerateResult, SamplingParams, ScoreRequest, ScoreResult

if TYPE_CHECKING:
    from lmbatch.grammar import GrammarCompiler  # imports xgrammar: loaded on the first constraint

EngineRequest = ScoreRequest | GenerateRequest
# token ids made before, by (the program's number in its task, the call's number in its program):
# (the call's digest, its ids)
KnownIds: TypeAlias = dict[tuple[int, int], tuple[bytes, CallIds]]
THINK_END = "</think>"      # the end-of-thinking marker of Qwen3, DeepSeek-R1 and most thinking models


def gen_ids(p: Pending) -> list[int]:
    """A prepared gen's prompt ids."""
    if not isinstance(p.ids, list):
        raise ValueError(f"call {p.op.name!r} has no prompt ids")
    return p.ids


def select_ids(p: Pending) -> SelectIds:
    """A prepared select's context and continuations."""
    if not isinstance(p.ids, tuple):
        raise ValueError(f"call {p.op.name!r} has no choice ids")
    return p.ids


def call_tokens(p: Pending) -> int:
    """Tokens a prepared call needs: prompt + new tokens, or context + longest choice."""
    if isinstance(p.op, Select):
        ctx, conts = select_ids(p)
        return len(ctx) + max(len(c) for c in conts)
    return len(gen_ids(p)) + new_tokens(p)


def new_tokens(p: Pending) -> int:
    """The most tokens a gen can write: its thinking and marker, then max_tokens."""
    op = cast(Gen, p.op)
    return op.max_tokens + (op.think_budget + len(p.think_ids) if op.think else 0)


@dataclass(frozen=True)
class CallOptions:
    """How calls become token ids: checked against the model's context (`max_len`; `truncate_left`
    drops a select's oldest context tokens instead of failing), grammars compiled against its
    `vocab_size`, once per distinct constraint (`grammar_cache`), their forced text jumped over
    (`jump_forward`); with `think_budget`, every gen thinks first, up to that many tokens, until
    `think_end` (a run's --think-budget, --think-end)."""
    max_len: int
    truncate_left: bool = False
    vocab_size: int | None = None
    jump_forward: bool = True
    grammar_cache: bool = True
    think_budget: int | None = None
    think_end: str | None = None


class CallPreparer:
    """Token ids of queued calls (each distinct text segment tokenized once, or known already),
    checked against the model's context; the grammars of constrained gens."""

    def __init__(self, encoder: TextEncoder, options: CallOptions):
        o = self.options = options
        self.encoder, self.max_len, self.truncate_left = encoder, o.max_len, o.truncate_left
        self.think_budget, self.think_end = o.think_budget, o.think_end
        self.vocab_size, self.jump_forward, self.grammar_cache = o.vocab_size, o.jump_forward, o.grammar_cache
        self.grammars: GrammarCompiler | None = None    # made on the first constraint
        self.truncated = 0              # selects whose context lost its oldest tokens
        self.tokenize_s = 0.0           # tokenizing calls' prompts, over every wave

    def prepare(self, pending: list[Pending], fail: Callable[[Pending, str], None], known: KnownIds | None = None,
                record: KnownIds | None = None) -> None:
        """Set each call's `ids`; a call that cannot run is passed to `fail` with the reason. `known`:
        token ids made before (a cached workload), taken where the call's text is the same; `record`
        gets each call's ids (before the context checks), by its program's number and its own."""
        t0 = time.perf_counter()
        try:
            self._prepare(pending, fail, known, record)
        finally:
            self.tokenize_s += time.perf_counter() - t0

    def _prepare(self, pending: list[Pending], fail: Callable[[Pending, str], None], known: KnownIds | None,
                 record: KnownIds | None) -> None:
        self.encoder.prefixes.next_round()     # a wave's texts begin with the last wave's
        gens, selects = [], []
        for p in pending:
            if isinstance(p.op, Select):
                selects.append(p)
                continue
            by_run = False
            if self.think_budget is not None and not p.op.think:
                by_run = True
                p.op = replace(p.op, think=True, think_budget=self.think_budget, think_end=self.think_end)
            try:
                if p.op.think:
                    p.think_ids = self._think_ids(p.op, by_run)
                if p.op.constrained:
                    self._constrain(p)
            except ValueError as e:
                p.bad = str(e)
            gens.append(p)
        ids: dict[int, CallIds] = {}
        digests = {id(p): call_digest(p) for p in pending} if known is not None or record is not None else {}
        for p in pending:
            hit = known.get((p.owner.number, p.seq)) if known is not None else None
            if hit is not None and hit[0] == digests[id(p)]:
                ids[id(p)] = hit[1]
        selects = [p for p in selects if id(p) not in ids]
        gens = [p for p in gens if id(p) not in ids]
        for encode, kind in ((self.encoder.encode_choices, "pair"), (self.encoder.encode_separate, "separate")):
            some = [p for p in selects if cast(Select, p.op).encoding == kind]
            for p, pair in zip(some, encode([(p.prompt, cast(Select, p.op).choices) for p in some]) if some else []):
                ids[id(p)] = pair
        for p, one in zip(gens, self.encoder.encode([p.prompt + p.forced for p in gens])):
            ids[id(p)] = one
        if record is not None:
            record.update(((p.owner.number, p.seq), (digests[id(p)], ids[id(p)])) for p in pending)
        for p in pending:
            try:
                if p.bad is not None:
                    bad, p.bad = p.bad, None
                    raise UserError(f"instance {p.owner.instance.id}: gen {p.op.name!r}: {bad}")
                p.ids = self._check(p, ids[id(p)])
            except (UserError, ValueError) as e:
                fail(p, str(e))

    def _constrain(self, p: Pending) -> None:
        """Compile the call's grammar and give it its own matcher; with jump-forward, the text the
        grammar forces at the start joins the prompt."""
        import lmbatch

        try:
            with lmbatch.IMPORT_LOCK:       # xgrammar imports transformers, as the model's thread does
                from lmbatch.grammar import GrammarCompiler
        except ImportError as e:
            raise ValueError(f"constrained gen needs xgrammar ({e}): pip install --no-deps xgrammar==0.2.8") from None
        if self.grammars is None:
            self.grammars = GrammarCompiler(self.encoder.hf, self.vocab_size, cache=self.grammar_cache)
        op = cast(Gen, p.op)       # only gen calls are constrained
        c = self.grammars.constraint(op.regex, op.json_schema, op.ebnf)
        # after thinking, the forced text comes after the marker (the engine jumps it there)
        forced = c.jump_forward() if self.jump_forward and not op.think else ""
        if forced:
            c.accept_string(forced)
        p.constraint, p.forced = c, forced
        p.meta["forced"] = forced       # shown by s.meta(name), as it always was

    def _think_ids(self, op: Gen, by_run: bool = False) -> tuple[int, ...]:
        """The end-of-thinking marker's ids: `think_end`, else `</think>` where the tokenizer has it
        (a token of its own, or in its chat template). `by_run`: the gen thinks because the run's
        --think-budget says so (a message then names the run's options, not the program's)."""
        hf = self.encoder.hf
        text = op.think_end
        if text is None:
            template = getattr(hf, "chat_template", None) or ""
            if THINK_END not in hf.get_vocab() and THINK_END not in str(template):
                what, fix = ("--think-budget", "pass --think-end MARKER") if by_run else ("think=True",
                                                                                          "pass think_end='...'")
                raise ValueError(f"{what}: the tokenizer has no {THINK_END} marker (no such token, not in its "
                                 f"chat template); {fix}")
            text = THINK_END
        ids = tuple(hf.encode(text, add_special_tokens=False))
        if not ids:
            raise ValueError("think_end is empty")
        return ids

    def _check(self, p: Pending, ids: CallIds) -> CallIds:
        inst = p.owner.instance.id
        if isinstance(p.op, Select):
            ctx, conts = cast(SelectIds, ids)
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
        if len(ids) + new_tokens(p) > self.max_len:
            raise UserError(f"instance {inst}: gen {p.op.name!r} needs {len(ids)} prompt + {new_tokens(p)} "
                            f"new tokens, more than the model's {self.max_len}-token context")
        return ids


def call_digest(p: Pending) -> bytes:
    """What decides a call's token ids: its kind, prompt, forced text and choices (a 16-byte hash)."""
    h = hashlib.blake2b(digest_size=16)
    if isinstance(p.op, Select):
        kind = b"select\0" if p.op.encoding == "pair" else b"select-" + p.op.encoding.encode() + b"\0"
        h.update(kind + p.prompt.encode() + b"\0" + "\x1f".join(p.op.choices).encode())
    else:
        h.update(b"gen\0" + (p.prompt + p.forced).encode())
    return h.digest()


def engine_requests(calls: list[Pending], seed: int) -> tuple[list[EngineRequest], list[Pending]]:
    """The engine requests of prepared calls (a select has one per choice), and the call of each."""
    requests: list[EngineRequest] = []
    owner: list[Pending] = []
    for p in calls:
        if isinstance(p.op, Select):
            ctx, conts = select_ids(p)
            for c in conts:
                requests.append(ScoreRequest(ctx, c))
                owner.append(p)
        else:
            op = p.op
            call_seed = hash((seed, p.owner.number, p.seq)) & 0x7FFFFFFF   # the same when resumed
            params = SamplingParams(op.max_tokens, op.temperature, op.top_p, call_seed, op.stop,
                                    think_end=p.think_ids, think_budget=op.think_budget if op.think else 0)
            requests.append(GenerateRequest(gen_ids(p), params, p.constraint))
            owner.append(p)
    return requests, owner


def resolve(p: Pending, results: Sequence[ScoreResult | GenerateResult]) -> None:
    """Set a call's value and meta from its engine results (one per choice of a select)."""
    if isinstance(p.op, Select):
        scores = cast(Sequence[ScoreResult], results)
        logprobs = [r.logprob for r in scores]
        best = max(range(len(logprobs)), key=logprobs.__getitem__)
        p.value = p.op.choices[best]
        p.meta.update(index=best, logprobs=logprobs, is_greedy=[r.is_greedy for r in scores],
                      num_tokens=[r.num_tokens for r in scores])
    else:
        r = cast(GenerateResult, results[0])
        p.value = p.forced + cast(str, r.text)
        p.meta.update(finish_reason=r.finish_reason, prompt_tokens=len(gen_ids(p)), output_tokens=len(r.token_ids),
                      steps=r.steps, jumped_tokens=r.jumped_tokens)
        if r.grammar_complete is not None:     # a constrained gen cut short is marked, never accepted
            p.meta["incomplete"] = not r.grammar_complete
        if r.thinking is not None:
            p.meta.update(thinking=r.thinking, think_tokens=r.think_tokens)
    p.ids = None
    p.done = True
