"""Decode attention alone, one layer, the kernels side by side on the same step: ours (the split decode
kernel at each number of key ranges, the cascade kernel) and FlashInfer's (the batch decode wrapper on
tensor cores, the multi-level cascade wrapper), each checked against a float32 reference first.

    python benchmarks/bench_decode_attention.py --rows 64,256,512 --out $OUT/attention.jsonl

Scenarios, as issue 55's step table: `own` (rows of 1,000 keys of their own), `shared` (a 2,000-key prefix
every row holds, then 100 + 64 keys of its own), `samples` (16 samples of each 800-key prompt, 64 keys of
their own). Each variant is timed as a CUDA graph replays it (triton.testing.do_bench_cudagraph, median: a
decode step's kernels run in graphs, without the host's launch costs); the floor reads the prefix once and
every row's own keys once, at the copy bandwidth measured here.

Variants: `split` (the decode kernel as a step runs it), `splitN` (N key ranges a row; `split1`: one
program a (row, KV head), no merge), `cascade` (the cascade kernel as a step runs it), `cascade@K=V,..`
(its settings overridden: S shared key ranges, M query rows a shared program, W its warps, N its key block,
P its pipeline stages, T the programs a shared level aims at, G the programs walking level blocks, whole=0
for own keys in ranges and a merge after), `fi-decode` (FlashInfer's batch decode on tensor cores),
`fi-cascade` (its two-level cascade: each prefix once for its rows, then own keys).
"""
from __future__ import annotations

import argparse
import json

import torch

HEADS, KV_HEADS, DIM = 12, 2, 128       # Qwen2.5-1.5B's attention (28 layers)
LAYERS = 28


def scenario(name: str, rows: int, g: torch.Generator) -> tuple[list[torch.Tensor], list[int], int]:
    """Each row's KV slots (int64, its shared keys first), how many of them it shares, and the pool size."""
    shared, own, group = {"own": (0, 1064, 1), "shared": (2000, 164, rows), "samples": (800, 64, 16)}[name]
    seqs, skip, nxt = [], [], 0
    for lo in range(0, rows, group):
        prefix = torch.arange(nxt, nxt + shared)
        nxt += shared
        for _ in range(min(group, rows - lo)):
            seqs.append(torch.cat([prefix, torch.arange(nxt, nxt + own)]))
            skip.append(shared)
            nxt += own
    perm = torch.randperm(nxt, generator=g)     # slots scattered over the pool, as a run leaves them
    return [perm[s] for s in seqs], skip, nxt


def reference(q, k, v, seqs, scale, rows) -> torch.Tensor:
    out = []
    for i in rows:
        kk = k[seqs[i]].float().repeat_interleave(HEADS // KV_HEADS, dim=1)      # [L, H, D]
        vv = v[seqs[i]].float().repeat_interleave(HEADS // KV_HEADS, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[i].float(), kk) * scale, dim=-1)
        out.append(torch.einsum("hl,lhd->hd", p, vv))
    return torch.stack(out)


SETTINGS = {"S": ("cascade", "SHARED_SPLITS"), "M": ("cascade", "BLOCK_M"), "W": ("cascade", "SHARED_WARPS"),
            "N": ("cascade", "SHARED_BLOCK_N"), "P": ("cascade", "SHARED_STAGES"), "T": ("cascade", "TARGET_PROGRAMS"),
            "G": ("cascade", "PROGRAMS"), "whole": ("decode", "WHOLE_FROM")}


def configured(variant: str):
    """Sets a `cascade@K=V,...` variant's settings on the kernel modules; returns the old values."""
    from lmbatch.kernels import cascade_attention, decode_attention

    mods = {"cascade": cascade_attention, "decode": decode_attention}
    old = {k: getattr(mods[m], a) for k, (m, a) in SETTINGS.items()}
    for kv in (variant.split("@")[1].split(",") if "@" in variant else []):
        key, val = kv.split("=")
        m, a = SETTINGS[key]
        setattr(mods[m], a, (10 ** 9 if val == "0" else 0) if key == "whole" else int(val))
    return lambda: [setattr(mods[m], a, old[k]) for k, (m, a) in SETTINGS.items()]


def ours_cascade(q, k, v, seqs, skip, indices, indptr, scale):
    from lmbatch.kernels.cascade_attention import CascadeLevels, cascade_attention

    T = len(seqs)
    lv = CascadeLevels(T, HEADS // KV_HEADS, q.device)
    per = lv.per_block
    lv.skip[:T] = torch.tensor(skip, dtype=torch.int32)
    lv.levels[:T] = torch.tensor([1 if s else 0 for s in skip], dtype=torch.int32)
    blocks, block_rows = [], []
    starts = indptr.tolist()
    i = 0
    while i < T:        # rows that share a prefix are consecutive: blocks of `per` of them
        j = i
        while j < T and j - i < per and skip[j] and torch.equal(seqs[j][:skip[j]], seqs[i][:skip[i]]):
            j += 1
        if j == i:
            i += 1
            continue
        blocks.append([starts[i], skip[i], 0, j - i])
        block_rows.append(list(range(i, j)) + [0] * (per - (j - i)))
        i = j
    nb = len(blocks)
    if nb > lv.max_blocks or nb == 0:
        return None
    if nb:
        lv.blocks[:nb] = torch.tensor(blocks, dtype=torch.int32)
        lv.block_rows[:nb] = torch.tensor(block_rows, dtype=torch.int32)
    lv.n_blocks[0] = nb
    return lambda: cascade_attention(q, k, v, indices, indptr, scale, 0.0, lv)


def flashinfer_decode(q, k, v, indices, indptr, scale):
    import flashinfer

    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=q.device)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    T = q.shape[0]
    w.plan(indptr, indices, torch.ones(T, dtype=torch.int32, device=q.device), HEADS, KV_HEADS, DIM, 1,
           sm_scale=scale, q_data_type=q.dtype, kv_data_type=k.dtype)
    kv = (k.unsqueeze(1), v.unsqueeze(1))
    return lambda: w.run(q, kv)


def flashinfer_cascade(q, k, v, seqs, skip, scale):
    """Two levels: each shared prefix once for its rows (one request of as many queries as rows), then
    each row's own keys."""
    import flashinfer

    dev = q.device
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    w = flashinfer.MultiLevelCascadeAttentionWrapper(2, ws, "NHD")
    T = len(seqs)
    qo0, kv0, idx0 = [0], [0], []
    i = 0
    while i < T:
        j = i
        while j < T and skip[j] and torch.equal(seqs[j][:skip[j]], seqs[i][:skip[i]]):
            j += 1
        j = max(j, i + 1)
        idx0.append(seqs[i][:skip[i]])
        qo0.append(j)
        kv0.append(kv0[-1] + skip[i])
        i = j
    own = [s[n:] for s, n in zip(seqs, skip)]
    kv1 = torch.tensor([0] + [len(o) for o in own]).cumsum(0)
    i32 = dict(dtype=torch.int32, device=dev)
    w.plan([torch.tensor(qo0, **i32), torch.arange(T + 1, **i32)],
           [torch.tensor(kv0, **i32), kv1.to(**i32)],
           [torch.cat(idx0).to(**i32), torch.cat(own).to(**i32)],
           [torch.ones(len(qo0) - 1, **i32), torch.ones(T, **i32)],
           HEADS, KV_HEADS, DIM, 1, causal=False, sm_scale=scale, q_data_type=q.dtype, kv_data_type=k.dtype)
    kv = torch.stack([k, v], dim=1).unsqueeze(2)        # [slots, 2, page 1, KVH, D]
    return lambda: w.run(q, kv)


def variants(spec: str) -> list[str]:
    """The variant list: commas part variants, except within a `cascade@` variant's settings."""
    out: list[str] = []
    for part in spec.split(","):
        if "=" in part and "@" not in part and out and "@" in out[-1]:
            out[-1] += "," + part
        else:
            out.append(part)
    return out


def timed(fn) -> float:
    """Microseconds a call takes replayed from a CUDA graph (median); eagerly where it cannot be captured."""
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
    except Exception:  # noqa: BLE001 - FlashInfer's wrappers without graph buffers may refuse a capture
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def main() -> None:
    from bench_decode import copy_bandwidth

    from lmbatch.kernels.decode_attention import decode_attention

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="64,256,512")
    ap.add_argument("--scenarios", default="own,shared,samples")
    ap.add_argument("--variants", default="split,split1,split2,split4,split8,split16,cascade,cascade@whole=0,"
                    "cascade@S=4,cascade@S=4,M=128,W=8,cascade@S=8,M=128,W=8,cascade@S=2,M=128,W=8,cascade@P=3,"
                    "fi-decode,fi-cascade")
    ap.add_argument("--flashinfer", action="store_true", help="FlashInfer's variants too (their JIT: minutes)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    g = torch.Generator().manual_seed(0)
    scale = DIM ** -0.5
    print("scenario | rows | variant | us a layer | ms a step (28 layers) | floor us | of floor | max err")
    for name in args.scenarios.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            seqs, skip, slots = scenario(name, rows, g)
            k = torch.randn(slots, KV_HEADS, DIM, generator=g).to("cuda", torch.bfloat16)
            v = torch.randn(slots, KV_HEADS, DIM, generator=g).to("cuda", torch.bfloat16)
            q = torch.randn(rows, HEADS, DIM, generator=g).to("cuda", torch.bfloat16)
            indices = torch.cat(seqs).to("cuda", torch.int32)
            indptr = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to("cuda", torch.int32)
            seqs_dev = [s.cuda() for s in seqs]
            check = list(range(0, rows, max(1, rows // 16)))
            ref = reference(q, k, v, seqs_dev, scale, check)
            once = len(torch.unique(indices))
            floor_us = once * KV_HEADS * DIM * 2 * 2 / bw * 1e6
            for variant in variants(args.variants):
                if (variant.startswith(("cascade", "fi-cascade")) and name == "own") or (
                        variant.startswith("fi-") and not args.flashinfer):
                    continue
                restore = configured(variant)
                try:
                    if variant.startswith("split"):
                        n = int(variant[5:]) if variant != "split" else None
                        fn = lambda n=n: decode_attention(q, k, v, indices, indptr, scale, splits=n)  # noqa: E731
                    elif variant.startswith("cascade"):
                        fn = ours_cascade(q, k, v, seqs, skip, indices, indptr, scale)
                    elif variant == "fi-decode":
                        fn = flashinfer_decode(q, k, v, indices, indptr, scale)
                    elif variant == "fi-cascade":
                        fn = flashinfer_cascade(q, k, v, seqs_dev, skip, scale)
                    else:
                        raise ValueError(variant)
                    if fn is None:
                        continue
                    out = fn()
                    err = (out[check].float() - ref).abs().max().item()
                    us = timed(fn)
                except Exception as e:  # noqa: BLE001 - a variant that cannot run is reported, the rest go on
                    print(f"{name} | {rows} | {variant} | failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    if "illegal memory" in str(e):
                        raise
                    continue
                finally:
                    restore()
                row = {"scenario": name, "rows": rows, "variant": variant, "us_layer": round(us, 2),
                       "ms_step": round(us * LAYERS / 1e3, 3), "floor_us": round(floor_us, 2),
                       "of_floor": round(floor_us / us, 3), "max_err": round(err, 5),
                       "device": torch.cuda.get_device_name()}
                print(" | ".join(str(row[c]) for c in ("scenario", "rows", "variant", "us_layer", "ms_step", "floor_us",
                                                        "of_floor", "max_err")), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
