"""The LM program frontend and its interpreter on a tiny random model with a small trained tokenizer:
results equal the engine's, forks compute their shared prefix once, waves change no result, the
post-hoc optimum is exact, and user program files run from the CLI."""
import json
import time

import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer
from typer.testing import CliRunner

from lmbatch.cli import app
from lmbatch.engine import Engine
from lmbatch.frontend import gen, select
from lmbatch.frontend.calls import CallOptions
from lmbatch.frontend.interpreter import Interpreter
from lmbatch.frontend.workload import Instance
from lmbatch.programs.mmlu import encode_choices
from lmbatch.requests import GenerateRequest, SamplingParams
from lmbatch.scheduler.planner import posthoc_figures, posthoc_unique, summarize

PREFIX = "You are a careful assistant. Answer every question briefly and precisely. " * 3


def run_programs(path, program, inputs, wave_tokens=None, kv=16384, **kw):
    tok = AutoTokenizer.from_pretrained(str(path))
    interp = Interpreter(tok, CallOptions(max_len=2048), **kw)
    interp.start(program, [Instance(str(k), x) for k, x in enumerate(inputs)])
    interp.execute(Engine.from_pretrained(path, tokenizer=tok, kv_cache_tokens=kv), wave_tokens)
    return interp, tok


def test_gen_equals_the_engines_greedy_generation(tiny_tok):
    def program(s, q):
        s += PREFIX + q
        s += gen("a", max_tokens=6)

    qs = ["What is two plus two?", "Name a color."]
    interp, tok = run_programs(tiny_tok, program, [{"q": q} for q in qs])
    eng = Engine.from_pretrained(tiny_tok, tokenizer=tok)
    want, _ = eng.generate([GenerateRequest(tok.encode(PREFIX + q, add_special_tokens=False), SamplingParams(6))
                            for q in qs])
    assert [r.state["a"] for r in interp.runs] == [w.text for w in want]
    assert [r.state.text for r in interp.runs] == [PREFIX + q + w.text for q, w in zip(qs, want)]


def test_fork_computes_the_shared_prefix_once_and_join_gathers(tiny_tok):
    def program(s, q):
        s += PREFIX + q
        forks = s.fork(3)
        for k, f in enumerate(forks):
            f += f" Option {k}:" + gen("x", max_tokens=4)
        forks.join()
        s["n"] = len(s["x"])

    interp, _ = run_programs(tiny_tok, program, [{"q": "Why?"}, {"q": "How?"}])
    st_ = interp.stats
    assert st_.computed_tokens == st_.unique_tokens          # every distinct prefix computed once
    assert st_.hit_rate == pytest.approx(st_.optimal_hit_rate, abs=1e-12) and st_.hit_rate > 0.6
    assert all(len(r.state["x"]) == 3 and r.state["n"] == 3 for r in interp.runs)
    assert interp.waves == 1 and interp.stages[0].calls == 6


def test_control_flow_stages_and_select_tokenization(tiny_tok):
    def program(s, q):
        s += q + " Answer:"
        s += gen("a", max_tokens=3)
        if len(s["a"]) >= 0:                                # a result read: the program waits here
            s += "\nSure? "
            s += select("ok", ["yes", "no"])
        s["ok_index"] = s.meta("ok")["index"]

    interp, tok = run_programs(tiny_tok, program, [{"q": "One"}, {"q": "Two"}, {"q": "Three"}])
    assert interp.waves == 2
    assert {k: (c.calls, c.requests) for k, c in interp.stages.items()} == {0: (3, 3), 1: (3, 6)}
    for run in interp.runs:
        sel = run.calls[1]
        assert sel.op.name == "ok" and sel.prompt.endswith("\nSure? ")
        meta = run.state.meta("ok")
        assert run.state["ok"] == ["yes", "no"][meta["index"]] == ["yes", "no"][run.state["ok_index"]]
        ctx, conts = encode_choices(tok, sel.prompt, ["yes", "no"])   # lm-eval's encode_pair
        assert meta["num_tokens"] == [len(c) for c in conts] and ctx[-1] != tok.encode(" ")[0]


def judged(s, q):
    """Two sampled steps, each judged by a select; the better one continues."""
    s += PREFIX + q
    forks = s.fork(2)
    forks += " Step:" + gen("step", max_tokens=5, temperature=0.9)
    for f in forks:
        f += " Good?" + select("ok", [" yes", " no"])
    best = max(forks, key=lambda f: f.meta("ok")["logprobs"][0])
    best += " So:" + gen("final", max_tokens=4)
    s["final"] = best["final"]


def test_waves_and_schedules_change_no_result(tiny_tok):
    inputs = [{"q": f"Question {k}?"} for k in range(6)]
    one, _ = run_programs(tiny_tok, judged, inputs)
    many, _ = run_programs(tiny_tok, judged, inputs, wave_tokens=1, kv=2048)
    fcfs, _ = run_programs(tiny_tok, judged, inputs, schedule="fcfs", wave_tokens=40)
    results = [[r.state["final"] for r in i.runs] for i in (one, many, fcfs)]
    assert results[0] == results[1] == results[2]
    assert many.waves > one.waves
    for i in (one, many):
        assert i.stats.hit_rate >= 0.95 * i.stats.optimal_hit_rate


def test_tallies_of_split_programs_absorbed_give_one_interpreters_counts(tiny_tok):
    """Programs split between two interpreters (as data-parallel workers run them, lmbatch/run/spread.py), their
    tallies absorbed into a third: the counts, stages and optimum of one interpreter running them all."""
    inputs = [{"q": f"Question {k}?"} for k in range(6)]
    one, tok = run_programs(tiny_tok, judged, inputs)
    parts = []
    for numbers in ([0, 2, 4], [1, 3, 5]):
        interp = Interpreter(tok, CallOptions(max_len=2048))
        interp.start(judged, [Instance(str(k), inputs[k]) for k in numbers], numbers)
        interp.execute(Engine.from_pretrained(tiny_tok, tokenizer=tok, kv_cache_tokens=16384))
        parts.append(interp)
    assert [r.state["final"] for r in sorted((r for i in parts for r in i.runs), key=lambda r: r.number)] == \
        [r.state["final"] for r in one.runs]
    merged = Interpreter(tok, CallOptions(max_len=2048)).tally
    for interp in parts:
        merged.absorb(interp.tally)
    merged.finish()
    a, b = merged.stats, one.stats
    assert (a.prompt_tokens, a.cached_tokens + a.computed_tokens, a.decode_tokens, a.requests, a.executed) == \
        (b.prompt_tokens, b.prompt_tokens, b.decode_tokens, b.requests, b.executed)
    assert a.unique_tokens == b.unique_tokens and a.optimal_hit_rate == b.optimal_hit_rate
    assert merged.prompt_tree_optimal_hit_rate == one.prompt_tree_optimal_hit_rate
    assert {k: (c.calls, c.requests, c.prompt_tokens) for k, c in merged.stages.items()} == \
        {k: (c.calls, c.requests, c.prompt_tokens) for k, c in one.stages.items()}
    # each half computes its own shared prefix: together more than one interpreter, never less than the optimum
    assert a.computed_tokens >= b.computed_tokens >= b.unique_tokens


def brute_optimum(prompts, generated):
    need = {tuple(p[:k]) for p in prompts for k in range(1, len(p) + 1)}
    decoded = {tuple(s[:k]) for s, g in generated for k in range(g + 1, len(s) + 1)}
    return len(need - decoded)


seqs = st.lists(st.integers(0, 3), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(st.lists(seqs, min_size=1, max_size=8), st.lists(st.tuples(seqs, seqs), max_size=4))
def test_posthoc_optimum_is_exact(prompts, gens):
    generated = [(p + o, len(p)) for p, o in gens]
    prompts = prompts + [p for p, _ in gens]
    assert posthoc_unique(prompts, generated) == brute_optimum(prompts, generated)
    # the prompts' own tree from the same sort: Theorem 3.1's figure, as summarize makes it
    assert posthoc_figures(prompts, generated)[1] == summarize(prompts).unique_tokens == \
        len({tuple(p[:k]) for p in prompts for k in range(1, len(p) + 1)})


USER_FILE = '''"""Capitals: a user program."""
from lmbatch.frontend import gen, select

def instances():
    return [{"id": f"c{k}", "country": c, "gold": g} for k, (c, g) in enumerate(
        [("France", "Paris"), ("Japan", "Tokyo"), ("Peru", "Lima")])]

def program(s, country):
    s += f"The capital of {country} is"
    s += select("city", [" Paris", " Tokyo", " Lima"])
    s += ". Its population is" + gen("pop", max_tokens=4, stop=".")

def score(instance, s):
    return {"acc": s["city"].strip() == instance["gold"]}
'''


def test_user_program_file_runs_from_the_cli(tiny_tok, tmp_path):
    f = tmp_path / "capitals.py"
    f.write_text(USER_FILE)
    r = CliRunner().invoke(app, ["run", str(f), "--model", str(tiny_tok), "--out", str(tmp_path), "--run-id", "u",
                                 "--quiet"])
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "u" / "summary.json").read_text())
    assert s["task"] == "capitals" and s["counts"]["instances"] == 3 and s["counts"]["calls"] == 6
    assert set(s["stages"]) == {"0", "1"} and s["accuracy"] == s["metrics"]["acc"]
    rows = pq.read_table(tmp_path / "u" / "instances.parquet").to_pylist()
    assert ([row["id"] for row in rows] == ["c0", "c1", "c2"]
            and [row["gold"] for row in rows] == ["Paris", "Tokyo", "Lima"])
    outs = [json.loads(row["outputs"]) for row in rows]
    assert all(set(o) == {"city", "pop"} and "." not in o["pop"] for o in outs)
    reqs = pq.read_table(tmp_path / "u" / "requests.parquet").to_pylist()
    assert {(row["kind"], row["stage"]) for row in reqs} == {("select", 0), ("gen", 1)}


@pytest.mark.parametrize("body, needle", [
    ("x = 1\n", "must define a function `program`"),
    ("def instances():\n    return [{'a': 1}]\ndef program(s, a):\n    raise KeyError('boom')\n",
     "program failed on instance 0: KeyError"),
    ("def instances():\n    return [1]\ndef program(s):\n    pass\n", "must return dicts"),
    ("import nosuchmodule\n", "ModuleNotFoundError"),
    # issue 47 item 8b: ids name results (resume, report --compare): one given twice is refused as the file loads
    ("def instances():\n    return [{'id': 'q', 'a': 1}, {'id': 'r', 'a': 2}, {'id': 'q', 'a': 3}]\n"
     "def program(s, a):\n    pass\n", "instances() returned id 'q' twice (items 0 and 2)"),
])
def test_bad_program_files_fail_in_one_line(tiny_tok, tmp_path, body, needle):
    f = tmp_path / "bad.py"
    f.write_text(body)
    r = CliRunner().invoke(app, ["run", str(f), "--model", str(tiny_tok), "--out", str(tmp_path), "--quiet"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert not list(tmp_path.glob("bad*"))[1:]


def test_a_later_call_that_cannot_run_fails_only_its_instance(tiny_tok):
    def program(s, n):
        s += "Count:"
        s += gen("a", max_tokens=2)
        s += " one" * n                                   # n = 3000: longer than the 2048-token context
        s += gen("b", max_tokens=2)

    interp, _ = run_programs(tiny_tok, program, [{"n": 3}, {"n": 3000}, {"n": 4}])
    errors = [r.error for r in interp.runs]
    assert errors[0] is None and errors[2] is None
    assert errors[1].startswith("instance 1: gen 'b' needs") and "2048-token context" in errors[1]
    assert interp.runs[0].state["b"] is not None and len(interp.runs[1].calls) == 1
    assert interp.runs[1].state["b"] == "" and interp.runs[1].state.meta("b")["error"] == errors[1]


def test_the_readme_example_program_runs(tiny_tok, tmp_path):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    example = (root / "examples" / "capitals.py").read_text()
    assert example in (root / "docs" / "usage.md").read_text()    # the docs show exactly this file
    r = CliRunner().invoke(app, ["run", str(root / "examples" / "capitals.py"), "--model", str(tiny_tok),
                                 "--out", str(tmp_path), "--run-id", "ex", "--quiet"])
    assert r.exit_code == 0, r.output
    rows = pq.read_table(tmp_path / "ex" / "instances.parquet").to_pylist()
    assert len(rows) == 2 and all(row["error"] is None for row in rows)
    outs = [json.loads(row["outputs"]) for row in rows]
    assert all(len(o["population"]) == 2 and len(o["code"]) == 5 for o in outs), outs


def test_a_first_wave_of_selects_planned_ahead_runs_that_plan(tiny_tok, monkeypatch):
    """`plan_ahead` (called while the model loads) plans a first wave of selects once; the engine
    runs that plan instead of making its own, with the same results. A first wave that is not all
    selects is left to the engine."""
    from lmbatch.engine import stream as engine_module
    from lmbatch.frontend import interpreter as interp_module

    def program(s, q):
        s += PREFIX + q + " Answer:"
        s += select("a", [" yes", " no", " maybe"])
        s += " Why?" + select("b", [" because", " so"])

    inputs = [{"q": q} for q in ("One?", "Two?", "Three?", "Four?")]
    plain, tok = run_programs(tiny_tok, program, inputs)
    calls = {"interpreter": 0, "engine": 0}
    for name, module in (("interpreter", interp_module), ("engine", engine_module)):
        def counted(*a, _name=name, _f=module.plan_requests, **k):
            calls[_name] += 1
            return _f(*a, **k)
        monkeypatch.setattr(module, "plan_requests", counted)
    interp = Interpreter(tok, CallOptions(max_len=2048))
    interp.start(program, [Instance(str(k), x) for k, x in enumerate(inputs)])
    interp.plan_first_wave()
    assert calls == {"interpreter": 1, "engine": 0}
    interp.stats.plan_s += 100.0        # as if planning ahead had taken longer than the execution
    t = time.perf_counter()
    interp.execute(Engine.from_pretrained(tiny_tok, tokenizer=tok))
    assert calls == {"interpreter": 1, "engine": 1}, "the second wave is planned by the engine"
    assert 0 < interp.stats.execute_s < time.perf_counter() - t     # the plan made ahead is not in here
    assert [r.state.variables() for r in interp.runs] == [r.state.variables() for r in plain.runs]
    assert [(r.state.meta("a"), r.state.meta("b")) for r in interp.runs] == \
        [(r.state.meta("a"), r.state.meta("b")) for r in plain.runs]

    calls.update(interpreter=0, engine=0)
    def generating(s, q):
        s += q
        s += gen("g", max_tokens=2)

    gens = Interpreter(tok, CallOptions(max_len=2048))
    gens.start(generating, [Instance("0", {"q": "Hi"})])
    assert len(gens.ready) == 1
    gens.plan_first_wave()
    assert calls["interpreter"] == 0


def test_one_wave_of_selects_takes_its_plans_optimum(tiny_tok):
    """A run of one wave without generation on one engine takes its optimum from the wave's plan instead of
    planning every executed prompt again: the same number the executed prompts' own tree gives."""
    from lmbatch.scheduler.planner import summarize

    def program(s, q):
        s += PREFIX + q + " Answer:"
        s += select("a", [" yes", " no", " maybe"])

    interp, _ = run_programs(tiny_tok, program, [{"q": q} for q in ("Is it?", "Is it?", "Why not", "Is it")])
    assert interp.waves == 1
    executed = [row.token_ids for rows in interp.tally.rows_by_run.values() for row in rows]
    assert len(executed) == interp.stats.executed < 3 * 4      # equal prompts ran once
    assert interp.stats.unique_tokens == summarize(executed).unique_tokens
    assert interp.stats.optimal_hit_rate == interp.prompt_tree_optimal_hit_rate > 0


def test_host_work_between_waves_runs_without_the_collector_and_what_it_made_is_frozen():
    """`settled_host_work`: the collector off inside, back on after; what was made inside (and what lived
    before) frozen, so the passes of the next wave do not walk it; `settle=False` changes nothing."""
    import gc

    from lmbatch.frontend.interpreter import settled_host_work

    was = gc.isenabled()
    gc.enable()
    try:
        with settled_host_work(False):
            assert gc.isenabled()
        before = gc.get_freeze_count()
        with settled_host_work():
            assert not gc.isenabled()
            made = [[k, k + 1] for k in range(1000)]
        assert gc.isenabled() and gc.get_freeze_count() >= before + len(made)
        ids = {id(m) for m in made}
        assert not any(id(o) in ids for o in gc.get_objects())        # in no generation the collector walks
    finally:
        gc.unfreeze()
        if not was:
            gc.disable()
