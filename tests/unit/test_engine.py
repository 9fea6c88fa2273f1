"""Executor + planner on tiny random models: exact token counts, optimal hit rate, schedule- and
budget-independent scores, eviction under a small pool, generation."""
import random

import numpy as np
import pytest
import torch
from conftest import random_requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmbatch.engine import Engine
from lmbatch.requests import GenerateRequest, GenerateResult, SamplingParams, ScoreRequest, ScoreResult
from lmbatch.scheduler.planner import make_plan


def engine(path, **kw):
    return Engine.from_pretrained(path, **kw)


def hf_score(hf, req: ScoreRequest) -> tuple[float, bool]:
    ids = torch.tensor([req.tokens])
    with torch.no_grad():
        lp = torch.log_softmax(hf(ids).logits[0].float(), -1)
    c = len(req.context)
    rows = lp[c - 1 : len(req.tokens) - 1]
    target = torch.tensor(req.continuation)
    return float(rows.gather(1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from conftest import make_tiny_hf
    path = tmp_path_factory.mktemp("llama-engine")
    return path, make_tiny_hf("llama", path, seed=5)


def test_scores_match_transformers(tiny_model):
    _, path, hf = tiny_model
    reqs = random_requests(random.Random(0), 24)
    results, stats = engine(path, kv_cache_tokens=2048, max_tokens_per_batch=64).score(reqs)
    for req, res in zip(reqs, results):
        lp, greedy = hf_score(hf, req)
        assert abs(res.logprob - lp) < 1e-4
        assert res.is_greedy == greedy
        assert res.num_tokens == len(req.continuation)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), n=st.integers(1, 30), budget=st.sampled_from([1, 5, 16, 200]))
def test_dfs_computes_each_edge_once(llama, seed, n, budget):
    path, _ = llama
    reqs = random_requests(random.Random(seed), n)
    longest = max(len(r.tokens) for r in reqs)
    _, stats = engine(path, kv_cache_tokens=longest + budget + 64, max_tokens_per_batch=budget).score(reqs)
    plan = make_plan([r.prompt for r in reqs], mergeable=[True] * len(reqs))
    assert stats.computed_tokens == plan.unique_tokens
    assert stats.cached_tokens == plan.prompt_tokens - plan.unique_tokens
    assert stats.hit_rate == pytest.approx(plan.optimal_hit_rate, abs=1e-12)
    distinct = {tuple(r.prompt) for r in reqs}
    assert stats.executed == len(distinct)
    assert stats.prompt_tokens == sum(len(p) for p in distinct)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6))
def test_scores_independent_of_budget_schedule_and_pool(llama, seed):
    path, _ = llama
    rng = random.Random(seed)
    reqs = random_requests(rng, 20)
    longest = max(len(r.tokens) for r in reqs)
    base, _ = engine(path, kv_cache_tokens=4096, cache=False).score(reqs)
    runs = [
        engine(path, kv_cache_tokens=4096, max_tokens_per_batch=rng.choice([1, 3, 7, 50, 4096])).score(
            reqs, schedule=rng.choice(["dfs", "fcfs", "random"]), seed=seed)[0],
        # pool as small as the longest request plus one batch: evicts and recomputes
        engine(path, kv_cache_tokens=longest + 8, max_tokens_per_batch=8).score(reqs)[0],
    ]
    for results in runs:
        for a, b in zip(base, results):
            assert abs(a.logprob - b.logprob) < 1e-5
            assert a.is_greedy == b.is_greedy


def test_small_pool_evicts_and_degrades_gracefully(llama):
    path, _ = llama
    reqs = random_requests(random.Random(7), 40)
    longest = max(len(r.tokens) for r in reqs)
    big = engine(path, kv_cache_tokens=4096, max_tokens_per_batch=8).score(reqs)
    small = engine(path, kv_cache_tokens=longest + 8, max_tokens_per_batch=8).score(reqs)
    assert small[1].evicted_tokens > 0
    assert small[1].hit_rate <= big[1].hit_rate
    assert [r.logprob for r in small[0]] == pytest.approx([r.logprob for r in big[0]], abs=1e-5)


def test_pool_smaller_than_a_request_is_a_clear_error(llama):
    path, _ = llama
    with pytest.raises(RuntimeError, match="cannot hold request"):
        engine(path, kv_cache_tokens=4, max_tokens_per_batch=4).score([ScoreRequest([1, 2, 3, 4], [5, 6])])


def test_no_cache_and_other_schedules_compute_more(llama):
    path, _ = llama
    reqs = random_requests(random.Random(3), 30)
    plan = make_plan([r.prompt for r in reqs], mergeable=[True] * len(reqs))
    _, dfs = engine(path).score(reqs)
    _, nocache = engine(path, cache=False).score(reqs)
    assert dfs.computed_tokens == plan.unique_tokens
    assert nocache.computed_tokens == plan.prompt_tokens and nocache.cached_tokens == 0


def test_greedy_generation_matches_transformers(tiny_model):
    _, path, hf = tiny_model
    prompts = [[3, 17, 42, 9], [3, 17, 42, 9, 100, 5], [77]]
    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in prompts]
    results, stats = engine(path, max_tokens_per_batch=5).generate(reqs)
    for p, res in zip(prompts, results):
        ids = list(p)
        with torch.no_grad():
            for _ in range(8):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        assert res.token_ids == ids[len(p):]
        assert res.finish_reason == "length" and res.decode_tokens == 8
    assert stats.decode_tokens == 24


def test_sampling_is_deterministic_and_batch_independent(llama):
    path, _ = llama
    reqs = [GenerateRequest([5, 6, 7, i], SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.9, seed=i,
                                                         ignore_eos=True)) for i in range(6)]
    a, _ = engine(path, max_tokens_per_batch=3).generate(reqs)
    b, _ = engine(path, max_tokens_per_batch=64, max_running=2).generate(reqs, schedule="random", seed=1)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert len({tuple(r.token_ids) for r in a}) > 1


def test_finished_rows_are_refilled_while_long_generations_run(llama):
    """Continuous batching with prefill ahead: with 2 rows, one 40-token generation and eight 10-token
    ones take one prefill forward (every prompt, ahead of admission) and decode steps that keep both
    rows busy: a row that finishes is refilled at the next step, at no forward of its own (the first
    token of a request comes from its prompt's logits, then 9 steps each). Static groups take 40 + 3 x 10
    steps; outputs are those of an unconstrained batch."""
    path, _ = llama
    lens = [40] + [10] * 8
    reqs = [GenerateRequest([3, 1, 4, i], SamplingParams(max_new_tokens=n, ignore_eos=True))
            for i, n in enumerate(lens)]
    free, _ = engine(path).generate(reqs)
    two, stats = engine(path, max_running=2).generate(reqs, schedule="fcfs")
    assert [r.token_ids for r in two] == [r.token_ids for r in free]
    assert [len(r.token_ids) for r in two] == lens
    row_steps = sum(n - 1 for n in lens)
    assert stats.forward_batches <= 1 + (row_steps + 1) // 2 + 1, stats.forward_batches


@pytest.mark.parametrize("wide_from", [4, 5])
def test_a_stream_of_many_generations_decodes_with_the_wide_rows(llama, monkeypatch, wide_from):
    """A stream that starts with WIDE_FROM generations or more decodes with the engine's `wide_rows` (4 rows
    here: 4 requests of 6 tokens in 5 steps after their prompts' batch), one of fewer with its `rows` (2: two
    rounds of 5 steps); the tokens are those of any row count."""
    import lmbatch.engine.stream

    path, _ = llama
    monkeypatch.setattr(lmbatch.engine.stream, "WIDE_FROM", wide_from)
    reqs = [GenerateRequest([3, 1, 4, i], SamplingParams(max_new_tokens=6, ignore_eos=True)) for i in range(4)]
    free, _ = engine(path).generate(reqs)
    got, stats = engine(path, max_running=2, wide_rows=4).generate(reqs, schedule="fcfs")
    assert [r.token_ids for r in got] == [r.token_ids for r in free]
    assert stats.forward_batches == (1 + 5 if wide_from <= len(reqs) else 1 + 2 * 5), stats.forward_batches


@pytest.mark.parametrize("per_round, extra", [(1024, 1), (3, 3)])
def test_first_tokens_of_queued_requests_take_one_sampling_round(llama, monkeypatch, per_round, extra):
    """Every request's first token comes from its prompt's logits: those of a whole wave, queued or
    running, are sampled in one round (one device sync), not one round per step that admits a request.
    So the rounds are the decode forwards plus one (plus one per further `per_round` queued requests:
    2 running + 7 queued take 3 rounds of 3), and the tokens those of a batch with a row each."""
    import lmbatch.engine.decode
    from lmbatch.engine.model_runner import ModelRunner
    from lmbatch.engine.sampler import Sampler
    monkeypatch.setattr(lmbatch.engine.decode, "FIRST_TOKEN_ROWS", per_round)
    path, _ = llama
    reqs = [GenerateRequest([2, 7, 1, i], SamplingParams(max_new_tokens=3 + i % 4, ignore_eos=True))
            for i in range(9)]
    free, _ = engine(path).generate(reqs)
    calls = {"pick": 0, "decode": 0}     # sampling rounds, decode forwards
    for cls, name in ((Sampler, "pick"), (ModelRunner, "decode")):
        def counted(self, *a, _name=name, _fn=getattr(cls, name)):
            calls[_name] += 1
            return _fn(self, *a)
        monkeypatch.setattr(cls, name, counted)
    two, _ = engine(path, max_running=2).generate(reqs, schedule="fcfs")
    assert [r.token_ids for r in two] == [r.token_ids for r in free]
    assert calls["decode"] >= sum(len(r.token_ids) - 1 for r in free) // 2
    assert calls["pick"] == calls["decode"] + extra, calls


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 9)), max_size=60))
def test_kv_pool_hands_out_each_slot_once(ops):
    """Allocations and frees in any order: allocated slots never overlap, every slot is either free
    or held, an allocation beyond the free count fails, and freeing more than was taken raises."""
    from lmbatch.attention.kv_pool import KVPool
    pool = KVPool(16, 1, 1, 1, torch.float32, "cpu")
    scratch = set(pool.reserve(1).tolist())
    held: list[np.ndarray] = []
    for alloc, n in ops:
        if alloc:
            free = pool.num_free
            got = pool.alloc(n)
            assert (got is None) == (n > free)
            if got is not None:
                assert len(got) == n
                held.append(got)
        elif held:
            pool.free(held.pop(n % len(held)))
        taken = [int(x) for h in held for x in h]
        assert len(taken) == len(set(taken)) and not set(taken) & scratch
        assert pool.num_free + len(taken) == 15
    everything = np.arange(16)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(everything)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), max_running=st.integers(1, 6), batch=st.sampled_from([3, 8, 64]),
       slack=st.integers(0, 40), cache=st.booleans())
def test_generation_under_pool_pressure_matches_a_large_pool(llama, seed, max_running, batch, slack, cache):
    """Prompts prefilled ahead of admission, with the pool just large enough for the longest request
    (plus a batch and `slack`): scores and generations equal those of a pool that holds everything,
    and every slot comes back to the pool."""
    path, _ = llama
    rng = random.Random(seed)
    reqs = []
    for r in random_requests(rng, 14):
        if rng.random() < 0.5:
            r = GenerateRequest(r.tokens, SamplingParams(max_new_tokens=rng.randint(1, 12), ignore_eos=True,
                                                         temperature=rng.choice([0.0, 0.8]), seed=seed))
        reqs.append(r)
    need = max(len(r.prompt) + (r.params.max_new_tokens if isinstance(r, GenerateRequest) else 0) for r in reqs)
    ref, _ = engine(path, kv_cache_tokens=4096).run(reqs)
    eng = engine(path, kv_cache_tokens=need + batch + slack, max_tokens_per_batch=batch, max_running=max_running,
                 cache=cache)
    out, _ = eng.run(reqs)
    for a, b in zip(ref, out):
        if isinstance(a, GenerateResult):
            assert a.token_ids == b.token_ids
        else:
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    if eng.tree is not None:
        eng.tree.evict(eng.pool.num_slots)
    assert eng.pool.num_free == eng.pool.num_slots


class CharTokenizer:
    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


def test_stop_strings_cut_the_text(llama):
    path, _ = llama
    eng = engine(path, tokenizer=CharTokenizer())
    free, _ = eng.generate([GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=12, ignore_eos=True))])
    text = CharTokenizer().decode(free[0].token_ids)
    stop = text[4:6]
    res, _ = engine(path, tokenizer=CharTokenizer()).generate(
        [GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=12, stop=(stop,), ignore_eos=True))])
    assert res[0].finish_reason == "stop"
    assert res[0].text == text[: text.find(stop)]


def test_progress_counts_decoded_tokens_as_they_come(llama, monkeypatch):
    """Issue 57: a generating run's progress callback hears of its tokens between decode steps (request -1), not
    only as each generation ends, so a bar moves while samples decode; its decode budget (each generation's
    most tokens) gives back what a generation that ends early (a stop string) did not use. TokenProgress fed so
    counts prompt tokens computed and tokens decoded, and ends at their sum."""
    import lmbatch.engine.state
    from lmbatch.run.progress import TokenProgress

    monkeypatch.setattr(lmbatch.engine.state, "PROGRESS_S", 0.0)     # every step reports
    path, _ = llama
    probe, _ = engine(path, tokenizer=CharTokenizer()).generate(
        [GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=12, ignore_eos=True))])
    stop = CharTokenizer().decode(probe[0].token_ids)[4:6]
    reqs = [GenerateRequest([3, 1, 4, i], SamplingParams(max_new_tokens=n, ignore_eos=True))
            for i, n in enumerate([30, 8, 8])]
    reqs.append(GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=12, stop=(stop,), ignore_eos=True)))
    bar = TokenProgress(disable=True)
    seen = []

    def progress(i, stats):
        seen.append((i, stats.decode_tokens + stats.decoding_tokens, stats.decode_budget))
        bar(i, stats)
        if i == -1 and not any(k >= 0 for k, _, _ in seen):     # nothing has ended yet: the bar moves anyway
            assert bar.n == stats.computed_tokens + stats.decoding_tokens > stats.computed_tokens
            assert bar.bar.total == stats.unique_tokens + 30 + 8 + 8 + 12

    res, stats = engine(path, tokenizer=CharTokenizer(), max_running=2).generate(reqs, schedule="fcfs",
                                                                                 progress=progress)
    assert res[3].finish_reason == "stop" and len(res[3].token_ids) < 12
    first_end = next(k for k, (i, _, _) in enumerate(seen) if i >= 0)
    assert first_end >= 5 and all(i == -1 for i, _, _ in seen[:first_end])
    decoded = [d for _, d, _ in seen]
    assert decoded == sorted(decoded) and decoded[first_end - 1] >= 5       # told as they came, never backwards
    assert seen[0][2] == 30 + 8 + 8 + 12 and seen[-1][2] == stats.decode_tokens == sum(len(r.token_ids) for r in res)
    assert stats.decoding_tokens == 0 and decoded[-1] == stats.decode_tokens
    bar.close()
    assert bar.n == bar.bar.total == stats.computed_tokens + stats.decode_tokens


def test_finished_generations_are_cached_for_later_calls(llama):
    path, _ = llama
    eng = engine(path)
    prompt = [9, 8, 7, 6, 5]
    res, _ = eng.generate([GenerateRequest(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))])
    follow = prompt + res[0].token_ids + [1, 2]
    out, stats = eng.score([ScoreRequest(follow[:-1], follow[-1:])])
    # everything but the last generated token (never run) and the new prompt token was cached
    assert stats.cached_tokens == len(prompt) + 6 - 1
    assert stats.computed_tokens == 2


def test_sampling_noise_is_finite_at_the_ends_of_its_range():
    """The uniform of the top 24-bit value used to round to 1.0: Gumbel noise +inf, so the token won
    even where its grammar had masked it to -inf (NaN wins argmax). Seen at 1 in ~2^24 draws."""
    from lmbatch.engine.sampling import _unit

    u = _unit(torch.tensor([0, 1, (1 << 24) - 2, (1 << 24) - 1]))
    assert bool(((u > 0) & (u < 1)).all()), u
    gumbel = -torch.log(-torch.log(u))
    assert bool(torch.isfinite(gumbel).all()), gumbel
    masked = torch.tensor([float("-inf"), 0.0]) + gumbel[[3, 0]]
    assert int(masked.argmax()) == 1


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 23), vocab=st.sampled_from([1, 5, 17, 64, 1000, 4099]), scale=st.floats(0.01, 30.0),
       seed=st.integers(0, 2**32))
def test_cpu_noise_a_few_rows_at_a_time_is_the_whole_batchs(rows, vocab, scale, seed):
    """`noisy_argmax` (the CPU's sampling: CPU_ROWS rows of noise at a time, in place) picks, row for row,
    the token of the whole batch's noise as the module's formula gives it, at any batch size and vocabulary
    (one not a multiple of the vector width too), and a row's pick is the same alone as in its batch."""
    from lmbatch.engine import sampling

    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=g) * scale
    seeds = torch.randint(-2**62, 2**62, (rows,), generator=g)
    steps = torch.randint(0, 10**6, (rows,), generator=g)
    whole = (z + -torch.log(-torch.log(sampling._uniform(seeds, steps, vocab)))).argmax(dim=-1)
    assert torch.equal(sampling.noisy_argmax(z, seeds, steps), whole)
    alone = [int(sampling.noisy_argmax(z[i:i + 1], seeds[i:i + 1], steps[i:i + 1])) for i in range(rows)]
    assert alone == whole.tolist()


def test_sampling_follows_the_distribution_and_top_p():
    from lmbatch.engine.sampling import sample

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    probs = torch.softmax(logits[0] / 0.7, -1)
    n = 20000
    draws = [sample(logits, [SamplingParams(temperature=0.7, seed=s)], [0])[0] for s in range(n // 2)]
    draws += [sample(logits, [SamplingParams(temperature=0.7, seed=7)], [k])[0] for k in range(n // 2)]
    freq = torch.bincount(torch.tensor(draws), minlength=5).float() / n
    assert torch.allclose(freq, probs, atol=0.015), (freq, probs)      # seeds and steps both give fresh draws
    # p = 0.64, 0.24, 0.09, ...: top_p 0.8 keeps the first two tokens, top_p 0.6 the first alone
    top = [sample(logits, [SamplingParams(temperature=1.0, top_p=0.8, seed=s)], [0])[0] for s in range(2000)]
    assert set(top) == {0, 1} and abs(top.count(1) / 2000 - 0.237 / 0.881) < 0.04
    assert {sample(logits, [SamplingParams(temperature=1.0, top_p=0.6, seed=s)], [0])[0] for s in range(300)} == {0}


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), every=st.integers(1, 7), batch=st.sampled_from([4, 16, 256]))
def test_handover_gives_each_result_once_as_final_and_changes_nothing(llama, seed, every, batch):
    """Engine.stream's handovers (what the run writes as result parts): every request is handed over
    exactly once, its result already what the run returns, the last handover holds the rest, and the
    run computes what it computes without handovers."""
    path, _ = llama
    rng = random.Random(seed)
    reqs = random_requests(rng, 30) + [
        GenerateRequest([rng.randrange(128) for _ in range(rng.randint(1, 9))],
                        SamplingParams(max_new_tokens=rng.randint(1, 6), temperature=0.7, seed=k)) for k in range(8)]
    rng.shuffle(reqs)
    plain, plain_stats = engine(path, max_tokens_per_batch=batch, max_running=3).run(reqs)
    calls = [0]

    def due():
        calls[0] += 1
        return calls[0] % every == 0

    seen: dict[int, object] = {}
    handovers = list(engine(path, max_tokens_per_batch=batch, max_running=3).stream(reqs, handover_due=due))
    assert len(handovers) > 1 and handovers[-1].last and not any(h.last for h in handovers[:-1])
    for h in handovers[:-1]:
        for i in h.final:
            assert i not in seen
            r = h.results[i]
            seen[i] = (r.logprob, r.is_greedy) if isinstance(r, ScoreResult) else list(r.token_ids)
    assert seen, "nothing was handed over before the end"
    assert sorted(list(seen) + handovers[-1].final) == list(range(len(reqs)))
    got, stats = handovers[-1].results, handovers[-1].stats
    for i, value in seen.items():
        r = got[i]
        assert value == ((r.logprob, r.is_greedy) if isinstance(r, ScoreResult) else r.token_ids)
    for a, b in zip(plain, got):
        if isinstance(a, ScoreResult):
            assert abs(a.logprob - b.logprob) < 1e-4
        else:
            assert a.token_ids == b.token_ids
    assert (stats.computed_tokens, stats.cached_tokens) == (plain_stats.computed_tokens, plain_stats.cached_tokens)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), batch=st.sampled_from([4, 16, 4096]), joins=st.integers(1, 4))
def test_an_open_stream_runs_joined_requests_in_tree_order(llama, seed, batch, joins):
    """Requests fed to a running stream (`feed`, as the interpreter feeds its programs' later calls): each is
    handed over once, with the result a run of its own batch gives; each joined batch runs in its own plan's
    DFS order and hits what the batches before it left in the cache: every distinct prefix is computed, and
    where no prompt is cut across prefill batches (4,096 tokens a batch) exactly what runs of the batches
    one after another compute; the stream ends when nothing runs and nothing joins."""
    from lmbatch.scheduler.planner import make_plan, plan_requests

    path, _ = llama
    rng = random.Random(seed)
    scores = random_requests(rng, 40, vocab=120)
    # generations: each prompt starts with a token of its own, so no other prompt can extend its output
    gens = [GenerateRequest([120 + k] + [rng.randrange(120) for _ in range(rng.randint(0, 8))],
                            SamplingParams(max_new_tokens=rng.randint(1, 6), temperature=0.7, seed=k))
            for k in range(6)]
    reqs = scores + gens
    rng.shuffle(reqs)
    cuts = sorted(rng.sample(range(1, len(reqs)), joins))
    batches = [reqs[a:b] for a, b in zip([0, *cuts], [*cuts, len(reqs)])]
    opts = dict(max_tokens_per_batch=batch, max_running=3)
    warm = engine(path, **opts)             # the batches one after another on one engine: the wave schedule
    ref = [warm.run(b) for b in batches]

    waiting, asked = list(batches[1:]), []

    def feed(idle):
        asked.append(idle)
        return waiting.pop(0) if waiting and (idle or rng.random() < 0.5) else []

    def value(r):
        return (r.logprob, r.is_greedy) if isinstance(r, ScoreResult) else list(r.token_ids)

    handovers, seen = [], {}
    for h in engine(path, **opts).stream(batches[0], feed=feed):
        handovers.append(h)
        seen.update((i, value(h.results[i])) for i in h.final)     # as handed over
    assert not waiting and asked[-1] is True and handovers[-1].last
    final = [i for h in handovers for i in h.final]
    assert sorted(final) == list(range(len(reqs)))          # each handed over once
    got, stats = handovers[-1].results, handovers[-1].stats
    assert all(seen[i] == value(got[i]) for i in seen)      # a result handed over was final
    base, order = 0, []
    for b, (results, _) in zip(batches, ref):
        order += [base + j for j in plan_requests(b, "dfs", 0).order]
        for k, r in enumerate(results):
            mine = got[base + k]
            if isinstance(r, ScoreResult):
                assert abs(mine.logprob - r.logprob) < 1e-4 and mine.is_greedy == r.is_greedy
            else:
                assert mine.token_ids == r.token_ids
        base += len(b)
    assert stats.order == order             # tree order, batch by batch
    assert stats.requests == len(reqs) and stats.executed == sum(s.executed for _, s in ref)
    for counted in ("decode_tokens", "prompt_tokens") + (("computed_tokens", "cached_tokens") if batch == 4096 else ()):
        assert getattr(stats, counted) == sum(getattr(s, counted) for _, s in ref), counted
    union = make_plan([r.prompt for r in reqs], mergeable=[isinstance(r, ScoreRequest) for r in reqs])
    assert stats.computed_tokens >= union.unique_tokens     # chunks cut elsewhere may recompute what logits need


@pytest.mark.parametrize("max_running", [4, 8])
def test_a_later_call_joins_while_others_decode_and_hits_its_prefix(llama, max_running):
    """A program's next calls (prompt + what it generated + more) fed to the stream as soon as its generation
    ends: they join while longer generations still decode (no barrier), find everything but the last generated
    token in the cache, and give what the same requests give run on their own."""
    path, _ = llama
    firsts = [GenerateRequest([100 + k, 5, 6, 7][: 2 + k % 3], SamplingParams(max_new_tokens=2 + 3 * k,
                              temperature=0.8, seed=k, ignore_eos=True)) for k in range(6)]
    eng = engine(path, max_tokens_per_batch=16, max_running=max_running)
    follow: dict[int, int] = {}             # first request -> its follow-ups' first index
    joined: list[tuple[bool, int]] = []     # (idle, requests that joined)
    state = {"results": None, "n": len(firsts), "handed": set()}
    later: list = []

    def feed(idle):
        new = []
        for i in sorted(state["handed"] - set(follow)):
            if i < len(firsts):             # a first call ended: its program's next two calls
                ids = firsts[i].prompt + list(state["results"][i].token_ids)
                follow[i] = state["n"] + len(new)
                new += [ScoreRequest(ids + [9], [10, 11]),
                        GenerateRequest(ids + [12], SamplingParams(max_new_tokens=3, temperature=0.8, seed=50 + i))]
        state["n"] += len(new)
        later.extend(new)
        joined.append((idle, len(new)))
        return new

    for h in eng.stream(firsts, feed=feed):
        state["results"] = h.results
        state["handed"] |= set(h.final)
    got = h.results
    assert sorted(follow) == list(range(len(firsts))) and len(got) == len(firsts) + len(later)
    assert any(n and not idle for idle, n in joined)      # joined while generations still ran
    alone, _ = engine(path, max_tokens_per_batch=16, max_running=max_running).run(later)
    for i, j in follow.items():
        out = len(got[i].token_ids)
        assert out == firsts[i].params.max_new_tokens
        score, gen = got[j], got[j + 1]
        assert score.cached_tokens == len(firsts[i].prompt) + out - 1       # all but the last generated token
        assert abs(score.logprob - alone[j - len(firsts)].logprob) < 1e-4
        assert gen.token_ids == alone[j + 1 - len(firsts)].token_ids
