"""Constrained generation (regex / JSON schema via xgrammar) through the frontend: outputs match
their constraint, grammars compile once per run, jump-forward saves forward passes, cut-short
outputs are marked incomplete, invalid constraints fail before model work."""
import re

import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from lmbatch.cli import app
from lmbatch.engine import Engine
from lmbatch.frontend import gen
from lmbatch.frontend.calls import CallOptions
from lmbatch.frontend.interpreter import Interpreter
from lmbatch.frontend.workload import Instance, LoadArgs
from lmbatch.model.config import ModelConfig
from lmbatch.model.embedded import embedded_model_dir
from lmbatch.programs import json_cities

PHONE = r"\(\d{3}\) \d{3}-\d{4}"
DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-[0-2]\d"


def run_programs(path, program, inputs, jump=True, grammar_cache=True):
    tok = AutoTokenizer.from_pretrained(str(path))
    cfg = ModelConfig.from_dir(path)
    interp = Interpreter(tok, CallOptions(max_len=2048, vocab_size=cfg.vocab_size, jump_forward=jump,
                                         grammar_cache=grammar_cache))
    interp.start(program, [Instance(str(k), x) for k, x in enumerate(inputs)])
    interp.execute(Engine.from_pretrained(path, tokenizer=tok, jump_forward=jump))
    return interp


def regex_program(s, who):
    s += f"{who}'s phone number is "
    s += gen("phone", max_tokens=24, regex=PHONE, temperature=0.8)
    s += " and birthday "
    s += gen("date", max_tokens=16, regex=DATE)
    s += ". Motto: "
    s += gen("short", max_tokens=2, regex=r"[a-z]{20}")       # cannot finish in 2 tokens


@pytest.mark.parametrize("jump", [True, False])
@pytest.mark.parametrize("cache", [True, False])
def test_regex_outputs_match_and_grammars_compile_once_per_run(tiny_tok, jump, cache):
    inputs = [{"who": n} for n in ("Ann", "Bob", "Cy", "Dee", "Eve")]
    interp = run_programs(tiny_tok, regex_program, inputs, jump=jump, grammar_cache=cache)
    for run in interp.runs:
        s = run.state
        assert run.error is None
        assert re.fullmatch(PHONE, s["phone"]) and re.fullmatch(DATE, s["date"])
        assert not s.meta("phone")["incomplete"] and not s.meta("date")["incomplete"]
        assert s.meta("short")["incomplete"] and s.meta("short")["finish_reason"] == "length"
    assert interp.grammars.compiled_count == (3 if cache else 15)
    phone = [r.state.meta("phone") for r in interp.runs]
    if jump:   # "(" is forced at the start, ") " and "-" in the middle: never decoded
        assert all(m["jumped_tokens"] > 0 and m["steps"] < m["output_tokens"] for m in phone)
        assert all(r.state["phone"].startswith("(") for r in interp.runs)
    else:
        assert all(m["jumped_tokens"] == 0 and m["steps"] == m["output_tokens"] for m in phone)


def yes_no_program(s, who):
    s += f"Is {who} here? Answer: "
    s += gen("answer", max_tokens=8, regex="(yes|no)")


@pytest.mark.parametrize("jump", [True, False])
def test_jump_forward_ends_output_where_only_the_stop_token_fits(tiny_tok, jump):
    """With jump-forward one sampled token decides each answer: the rest of the word and the stop
    token are forced, so no decode step runs for them. Without it every token is a step."""
    interp = run_programs(tiny_tok, yes_no_program, [{"who": n} for n in ("Ann", "Bob", "Cy", "Dee")], jump=jump)
    for run in interp.runs:
        m = run.state.meta("answer")
        assert run.state["answer"] in ("yes", "no") and m["finish_reason"] == "eos" and not m["incomplete"]
        if jump:
            assert m["steps"] == 1 and m["jumped_tokens"] >= 1, m
        else:
            assert m["steps"] == m["output_tokens"] >= 2 and m["jumped_tokens"] == 0, m


def test_json_workload_outputs_validate_and_jump_forward_saves_steps():
    path = embedded_model_dir()
    tok = AutoTokenizer.from_pretrained(str(path))
    insts = json_cities.instances(LoadArgs(tok, limit=4))
    steps = {}
    for jump in (True, False):
        interp = run_programs(path, json_cities.program, [i.inputs for i in insts], jump=jump)
        scores = [json_cities.score(i, r.state) for i, r in zip(insts, interp.runs)]
        done = [sc for sc in scores if sc["complete"]]
        assert len(done) >= 3 and all(sc["valid"] for sc in done), scores
        steps[jump] = sum(r.state.meta("json")["steps"] for r in interp.runs)
    assert steps[True] < 0.7 * steps[False], steps


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_when_masks_are_filled_changes_no_output(tiny_tok, temperature, monkeypatch):
    """A grammar row keeps its unconstrained pick when the grammar accepts it (fixed sampling noise
    makes that the masked pick too) and computes a mask only otherwise ("lazy"); "overlap" masks some
    rows ahead, while the device is busy (here: a probe that says busy for one look per step, time
    for 4 masks), and the rest lazily. Same tokens as masking every row at every step ("eager"), with fewer masks."""
    import lmbatch.engine.sampler
    from lmbatch.grammar import GrammarCompiler
    from lmbatch.programs.json_cities import SCHEMA
    from lmbatch.requests import GenerateRequest, SamplingParams

    def one_look(logits):
        looks = iter([True])
        return lambda: next(looks, False)
    monkeypatch.setattr(lmbatch.engine.sampler, "_device_busy", one_look)
    tok = AutoTokenizer.from_pretrained(str(tiny_tok))
    gc = GrammarCompiler(tok, vocab_size=ModelConfig.from_dir(tiny_tok).vocab_size)
    out = {}
    for masks in ("lazy", "eager", "overlap"):
        reqs = [GenerateRequest(tok.encode(f"{name} as JSON: "), SamplingParams(48, temperature, seed=i),
                                gc.constraint(regex=r"[a-z]{2,9}-\d{3} [A-Z][a-z]+")
                                if i % 2 else gc.constraint(json_schema=SCHEMA))
                for i, name in enumerate(["Oslo", "Lima", "Rome", "Kyiv", "Doha", "Baku",
                                          "Nuuk", "Apia", "Suva", "Male", "Bern"])]
        res, stats = Engine.from_pretrained(tiny_tok, tokenizer=tok, masks=masks, max_running=8).generate(reqs)
        out[masks] = [r.token_ids for r in res], stats.masked_rows, stats.resampled_rows, sum(r.steps for r in res)
    assert out["lazy"][0] == out["eager"][0] == out["overlap"][0]
    assert out["eager"][1] == out["eager"][3] and out["eager"][2] == 0     # every step of every row masked ahead
    assert 0 < out["lazy"][2] == out["lazy"][1] < out["eager"][1]           # only rejected rows, a second round each
    ahead = out["overlap"][1] - out["overlap"][2]
    assert 0 < ahead < out["eager"][1] and 0 < out["overlap"][2] < out["lazy"][2], out


def test_validator_rejects_what_the_schema_forbids():
    ok = '{"name":"Oslo","country":"Norway","population":709037,"founded":"1040","landmarks":["Opera"]}'
    assert json_cities.valid(ok)
    for bad in ['{"name":"Oslo"}', ok.replace("709037", "-1"), ok.replace('"1040"', "1040"),
                ok.replace('["Opera"]', '["a","b","c","d"]'), ok[:-1], ok.replace('"Oslo"', '""')]:
        assert not json_cities.valid(bad), bad


@pytest.mark.parametrize("constraint, needle", [
    ("regex='[a-'", "invalid regex"),
    ("ebnf='root ::= number'", "invalid EBNF grammar"),
    ("json_schema={'type': 'object', 'properties': {'a': {'type': 'nosuchtype'}}}", "invalid JSON schema"),
])
def test_invalid_constraints_fail_before_model_work(tiny_tok, tmp_path, constraint, needle):
    f = tmp_path / "bad.py"
    f.write_text("from lmbatch.frontend import gen\n"
                 "def instances():\n    return [{'id': 'first'}, {'id': 'second'}]\n"
                 f"def program(s):\n    s += 'x'\n    s += gen('g', {constraint})\n")
    r = CliRunner().invoke(app, ["run", str(f), "--model", str(tiny_tok), "--out", str(tmp_path), "--quiet"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "instance first: gen 'g'" in lines[0] and needle in lines[0], r.stderr


def test_invalid_constraint_in_a_later_stage_fails_its_instances(tiny_tok, tmp_path):
    """As the README says: known only once earlier outputs exist, it fails the instance (error column),
    and the run goes on."""
    import pandas as pd

    f = tmp_path / "later.py"
    f.write_text("from lmbatch.frontend import gen\n"
                 "def instances():\n    return [{'id': 'first'}, {'id': 'second'}]\n"
                 "def program(s):\n    s += 'x' + gen('a', max_tokens=2)\n    s += gen('g', regex='[a-')\n")
    r = CliRunner().invoke(app, ["run", str(f), "--model", str(tiny_tok), "--out", str(tmp_path), "--run-id", "r",
                                 "--quiet"])
    assert r.exit_code == 0, r.output
    df = pd.read_parquet(tmp_path / "r" / "instances.parquet")
    assert len(df) == 2 and all("invalid regex" in e for e in df["error"]), df["error"].tolist()


# xgrammar's EBNF: arithmetic over integers with parentheses (recursive: no regex says it), and one
# line of CSV with quoted fields
ARITH = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9] [0-9]* | "(" expr ")"
"""
CSV = """root ::= field ("," field)* "\\n"
field ::= [a-z0-9 ]* | "\\"" ([^"\\n] | "\\"\\"")* "\\""
"""


def _arith(text: str) -> bool:
    """A recursive-descent parser of ARITH's language (the whole text)."""
    pos = 0

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while pos < len(text) and text[pos] in "+-":
            pos += 1
            if not term():
                return False
        return True

    def term() -> bool:
        nonlocal pos
        if not factor():
            return False
        while pos < len(text) and text[pos] in "*/":
            pos += 1
            if not factor():
                return False
        return True

    def factor() -> bool:
        nonlocal pos
        if pos < len(text) and text[pos].isdigit():
            while pos < len(text) and text[pos].isdigit():
                pos += 1
            return True
        if pos < len(text) and text[pos] == "(":
            pos += 1
            if not expr() or pos >= len(text) or text[pos] != ")":
                return False
            pos += 1
            return True
        return False

    return expr() and pos == len(text)


CSV_LINE = re.compile(r'(?:[a-z0-9 ]*|"(?:[^"\n]|"")*")(?:,(?:[a-z0-9 ]*|"(?:[^"\n]|"")*"))*\n')


def ebnf_program(s, n):
    s += f"Question {n}: compute something. Expression: "
    s += gen("expr", max_tokens=40, ebnf=ARITH, temperature=0.9)
    s += "\nA row of the table: "
    s += gen("row", max_tokens=40, ebnf=CSV, temperature=0.9)
    s += "\n"
    s += gen("answer", max_tokens=12, ebnf='root ::= "The answer is " [0-9] [0-9]? "."')


def _finish_arith(text: str) -> str:
    """The shortest ending that makes a prefix of ARITH's language whole."""
    return text + ("1" if not text or text[-1] in "+-*/(" else "") + ")" * (text.count("(") - text.count(")"))


def _finish_csv(text: str) -> str:
    return text + ('"' if text.count('"') % 2 else "") + "\n"


def test_ebnf_outputs_parse_under_their_grammar(tiny_tok):
    interp = run_programs(tiny_tok, ebnf_program, [{"n": k} for k in range(12)])
    assert interp.grammars is not None and interp.grammars.compiled_count == 3     # once per distinct grammar
    complete = cut = 0
    for run in interp.runs:
        s = run.state
        assert run.error is None, run.error
        for name, ok, finish in (("expr", _arith, _finish_arith), ("row", CSV_LINE.fullmatch, _finish_csv)):
            if s.meta(name).get("incomplete"):       # cut by max_tokens, marked: a prefix of the language
                cut += 1
                assert not ok(s[name]) or name == "expr", (name, s[name])
                assert ok(finish(s[name])), (name, s[name])
            else:
                complete += 1
                assert ok(s[name]), (name, s[name])
    assert complete >= 6 and cut >= 1
    for run in interp.runs:        # forced text is jumped over, and the grammar ends the output
        s = run.state
        assert s.meta("answer")["forced"] == "The answer is " and re.fullmatch(r"The answer is \d\d?\.", s["answer"])
    assert not _arith("1+(2*") and not _arith("(1)2") and CSV_LINE.fullmatch('a,"b""c",\n')
    assert _arith(_finish_arith("(1+(2*")) and not CSV_LINE.fullmatch('a,"b')
