"""The model on its device: the KV pool, the attention backend, the decode CUDA graphs, and the two
kinds of forward pass the engine runs (a ragged batch of prompt chunks; one decode step).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from lmbatch.attention.base import ForwardBatch, default_backend, make_backend
from lmbatch.attention.kv_pool import KVPool, LatentKVPool, Slots
from lmbatch.attention.registry import REFERENCE, REGISTRY, able
from lmbatch.engine.options import DECODE_ROWS
from lmbatch.engine.threads import CpuThreads
from lmbatch.errors import UserError
from lmbatch.model.network import Transformer

if TYPE_CHECKING:
    from lmbatch.engine.graphs import DecodeGraphs
    from lmbatch.engine.options import EngineOptions
    from lmbatch.engine.radix_cache import Node
    from lmbatch.engine.state import Running
    from lmbatch.model.fallback import HFCausalLM

    # our network, or a causal LM transformers runs behind the same forward (cfg.runtime "transformers")
    LanguageModel = Transformer | HFCausalLM


_UNCAPTURED = np.full(1, -1, dtype=np.int64)      # a logits row no key captures (a decode row's)


@dataclass
class TokenBatch:
    """A ragged batch being built: each sequence's new tokens, their KV slots, and the rows (tokens)
    whose logits are computed, with the plan position each of them is captured for."""
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    out_slots: list[Slots] = field(default_factory=list)
    kv: list[Slots] = field(default_factory=list)
    qo_indptr: list[int] = field(default_factory=lambda: [0])
    kv_indptr: list[int] = field(default_factory=lambda: [0])
    logit_rows: list[np.ndarray] = field(default_factory=list)
    logit_keys: list[np.ndarray] = field(default_factory=list)    # LogitCapture's keys (-1: nobody captures)

    @property
    def num_tokens(self) -> int:
        return self.qo_indptr[-1]

    def add(self, ids: list[int], start: int, out_slots: Slots, kv_slots: Slots, positions: np.ndarray,
            keys: np.ndarray) -> None:
        """A sequence's new tokens (from position `start`), the slots they write and the slots they read,
        and the positions whose logits are wanted with the key each is captured for."""
        row0 = self.num_tokens
        n = len(ids)
        self.ids.extend(ids)
        self.positions.extend(range(start, start + n))
        self.out_slots.append(out_slots)
        self.kv.append(kv_slots)
        self.qo_indptr.append(row0 + n)
        self.kv_indptr.append(self.kv_indptr[-1] + len(kv_slots))
        self.logit_rows.append(positions + (row0 - start))
        self.logit_keys.append(keys)

    def build(self) -> ForwardBatch:
        return ForwardBatch(torch.tensor(self.ids), torch.tensor(self.positions),
                            torch.from_numpy(np.concatenate(self.out_slots)), self.qo_indptr, self.kv_indptr,
                            torch.from_numpy(np.concatenate(self.kv)),
                            torch.from_numpy(np.concatenate(self.logit_rows)))


class ModelRunner:
    def __init__(self, model: LanguageModel, options: EngineOptions):
        """The pool, backend and graphs `options` ask for (`kv_cache_tokens` decided: engine/build.py fits it).
        Deterministic: the model's GEMMs in fixed row blocks and the backend's batch-independent path
        (decode graphs attend with the extend kernel, which reads a query's keys in the same blocks
        whatever the batch); the transformers fallback has no such path."""
        cfg, o = model.cfg, options
        self.model = model
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        native = cfg.runtime == "native"
        if o.deterministic and not native:
            raise UserError(f"--deterministic needs a model lmbatch runs itself; {cfg.model_type} runs on the "
                            "transformers fallback")
        # the transformers fallback attends by itself: of the backend it uses only the pool and plan
        why_torch = cfg.torch_attention_only() if native else None
        attention = (o.attention or default_backend(self.device, dtype, why_torch is not None)) if native else REFERENCE
        entry = REGISTRY[attention]
        if why_torch and not entry.latent:
            raise UserError(f"--attention {attention}: {cfg.model_type} has {why_torch}; use {REFERENCE} or auto")
        if cfg.attn_sinks and not entry.sinks:
            raise UserError(f"--attention {attention}: {cfg.model_type} has attention sinks, which only the "
                            f"{able('sinks')} backends compute")
        # decode steps replay CUDA graphs (not for the torch reference backend, which stays eager, nor
        # for the fallback); one extra slot is the graphs' scratch for padded rows
        use_graphs = o.cuda_graphs and native and self.device.type == "cuda" and entry.graphs
        pool = LatentKVPool if cfg.keys_are_values else KVPool
        self.pool = pool(cast(int, o.kv_cache_tokens) + use_graphs, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                         dtype, self.device)
        self.attn = make_backend(attention, self.pool, cfg.num_heads, cfg.head_dim, cfg.attn_scale,
                                 cfg.attn_softcap)
        self.attn.deterministic = o.deterministic
        if o.deterministic:
            cast(Transformer, model).set_deterministic(True)
        # CPU: each forward batch's torch threads sized to the cores other processes leave free (or --threads)
        self.threads = CpuThreads(o.threads) if self.device.type == "cpu" else None
        self.graphs: DecodeGraphs | None = None
        self._captured = False      # graphs are captured at the first decode step unless asked before
        if use_graphs:
            from lmbatch.engine.graphs import DecodeGraphs
            # a row per token: a step's rows after jump-forwards may outnumber its requests
            scratch = int(self.pool.reserve(1)[0])
            rows = cast(int, o.max_running)     # graphs to twice the rows (jump-forward), past DECODE_ROWS only to them
            ahead = min(2 * rows, max(rows, DECODE_ROWS))
            # a wide stream's rows (EngineOptions.wide_rows) have buffers; their graphs wait for such a stream
            self.graphs = DecodeGraphs(cast(Transformer, model), self.pool, scratch, max(ahead, o.wide_rows or rows),
                                       ahead)
            self.graphs.deterministic = o.deterministic
            if entry.levels != "never" and not o.deterministic and not cfg.attn_sinks:     # the levels have no sinks
                self.graphs.use_cascade(every_step=entry.levels == "every")

    def capture_graphs(self, rows: int | None = None) -> None:
        """Capture every decode graph now (a run that only scores never needs them); `rows`: those of steps
        that large too (a stream of wide rows)."""
        if self.graphs is None:
            return
        if rows is not None:
            self.graphs.capture_all(rows)
        elif not self._captured:
            self.graphs.capture_all()
        self._captured = True

    def forward(self, batch: TokenBatch) -> torch.Tensor:
        """Logits at the batch's logit rows (launched; the device may still be computing them)."""
        if self.threads is not None:
            self.threads.apply(batch.num_tokens)
        return self.model(batch.build().to(self.device), self.attn)

    def decode(self, rows: list[Running], pending: torch.Tensor | None = None) -> torch.Tensor:
        """Run each row's tokens that are not in the KV pool yet (one after a sampled token, several
        after a jump-forward); logits at each row's last token. On CUDA every token is one row of
        the decode graphs: a row's tokens sit at consecutive positions, and every layer stores all
        rows' KV before attending, so each token attends to those before it in the same step.
        A row with a `pending` token (graphs only) feeds that token, still on the device: row
        `pending_src` of `pending`, the tokens the last step sampled."""
        if self.graphs is not None:
            self.capture_graphs()
            if all(r.pending or len(r.out) == r.fed + 1 for r in rows):    # a token a row (no jump-forward)
                return self._decode_one(rows, pending)
            toks, positions, seqs, last, src = [], [], [], [], []
            ends: list[Node | None] | None = [] if self.graphs.levels is not None else None     # cascade
            for r in rows:
                start = r.prompt_len + r.fed
                slots = r.slots
                if r.pending:
                    toks.append(0)
                    positions.append(start)
                    seqs.append(slots)
                    src.append(r.pending_src)
                    r.fed += 1
                else:
                    for j, t in enumerate(r.out[r.fed:]):
                        toks.append(t)
                        positions.append(start + j)
                        seqs.append(slots)
                        src.append(-1)
                    r.fed = len(r.out)
                if ends is not None:
                    ends += [r.node] * (len(toks) - len(ends))
                last.append(len(toks) - 1)
            feed = (np.array(src), pending) if pending is not None else None
            return self.graphs.run(toks, positions, seqs, last, feed, ends)
        b = TokenBatch()
        for r in rows:
            start, end = r.prompt_len + r.fed, r.prompt_len + len(r.out)
            b.add(r.out[r.fed:], start, r.slots[start:end], r.slots[:end], np.array([end - 1]), _UNCAPTURED)
            r.fed = len(r.out)
        return self.forward(b)

    def _decode_one(self, rows: list[Running], pending: torch.Tensor | None) -> torch.Tensor:
        """`decode` where every row feeds one token: the one the last step sampled on the device (overlapped
        decode's steady state), or one the host appended (a first token from the prompt's logits, a grammar's
        pick), as in a step that admits requests; its logits every row's. No list of each row's tokens and
        no row picked from the logits (the general path's, for jump-forwards)."""
        graphs = cast("DecodeGraphs", self.graphs)
        positions = [r.prompt_len + r.fed for r in rows]
        tokens = [0 if r.pending else r.out[r.fed] for r in rows]
        feed = None
        if pending is not None:
            feed = (np.fromiter((r.pending_src if r.pending else -1 for r in rows), dtype=np.int64, count=len(rows)),
                    pending)
        else:
            assert not any(r.pending for r in rows), "a token sampled on the device needs the step's tokens"
        for r in rows:
            r.fed += 1
        ends = [r.node for r in rows] if graphs.levels is not None else None
        return graphs.run(tokens, positions, [r.slots for r in rows], None, feed, ends)

    @torch.inference_mode()
    def warm_up(self, tokens: int = 16) -> None:
        """Run one small prefill batch and its logit reduction, so that kernel compilation and
        library loading happen now (on the loader's thread) rather than in the first real batch.
        Its KV goes to slots that are freed again."""
        if self.device.type != "cuda":
            return
        slots = cast(Slots, self.pool.alloc(tokens))     # before any run: the pool has room
        b = TokenBatch()
        b.add([0] * tokens, 0, slots, slots, np.array([tokens - 1]), _UNCAPTURED)
        logits = self.forward(b)
        torch.log_softmax(logits, dim=-1).argmax(dim=-1).cpu()
        self.pool.free(slots)
