"""Thinking then constrained output (issue 24): with an end-of-thinking marker that spans several
tokens of the test tokenizer, nothing constrains the thinking, the constraint applies from the end
of the marker on (its forced text jumped there), the budget appends the marker, the thinking's KV is
cached like any generated text, and a tokenizer without a marker is one line."""
from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoTokenizer
from typer.testing import CliRunner

from lmbatch.cli import app
from lmbatch.engine import Engine
from lmbatch.engine.sampler import Sampler
from lmbatch.engine.state import Running
from lmbatch.frontend import gen
from lmbatch.frontend.calls import CallOptions
from lmbatch.frontend.interpreter import Interpreter
from lmbatch.frontend.workload import Instance
from lmbatch.grammar import GrammarCompiler
from lmbatch.model.config import ModelConfig
from lmbatch.requests import SamplingParams

MARKER = "</think>"
CODE = r"x[0-9]{3}"         # forces "x" first: jump-forward puts it right after the marker


@pytest.fixture(scope="module")
def tok(tiny_tok):
    return AutoTokenizer.from_pretrained(str(tiny_tok))


def test_the_marker_spans_several_tokens(tok):
    assert len(tok.encode(MARKER, add_special_tokens=False)) >= 3


def test_written_marker_ends_thinking_and_the_grammar_starts_after_it(tiny_tok, tok):
    cfg = ModelConfig.from_dir(tiny_tok)
    marker = tuple(tok.encode(MARKER, add_special_tokens=False))
    sampler = Sampler(cfg, torch.device("cpu"), tokenizer=tok)
    c = GrammarCompiler(tok, cfg.vocab_size).constraint(regex=CODE)
    params = SamplingParams(max_new_tokens=8, think_end=marker, think_budget=50)
    r = Running(0, None, torch.zeros(0, dtype=torch.int64), 0, params, c, thinking=True)
    thought = tok.encode("Let me see: letters, not digits.", add_special_tokens=False)
    for t in thought + list(marker[:-1]):       # not constrained: the grammar would reject these
        sampler._append(r, t)
        assert r.thinking and not r.finish and r.constraint.steps == []
    sampler._append(r, marker[-1])
    assert not r.thinking and r.think_start == len(thought) and r.think_len == len(thought) + len(marker) + 0
    assert tok.decode(r.out[r.think_len:]) == "x"       # the grammar's forced text, after the marker
    assert sampler.thinking(r) == "Let me see: letters, not digits."


def _run(path, program, n):
    tok = AutoTokenizer.from_pretrained(str(path))
    cfg = ModelConfig.from_dir(path)
    interp = Interpreter(tok, CallOptions(max_len=2048, vocab_size=cfg.vocab_size))
    interp.start(program, [Instance(str(k), {"k": k}) for k in range(n)])
    engine = Engine.from_pretrained(path, tokenizer=tok)
    interp.execute(engine)
    return interp, engine, tok


def test_budget_appends_the_marker_then_the_constraint_holds(tiny_tok, monkeypatch):
    from lmbatch.frontend import interpreter as interp_module

    outputs = {}

    def resolve(p, results, _resolve=interp_module.resolve):
        outputs[p.owner.instance.id] = (p.ids, results[0].token_ids)
        _resolve(p, results)
    monkeypatch.setattr(interp_module, "resolve", resolve)

    def program(s, k):
        s += f"Question {k}: think, then give the code."
        s += gen("code", max_tokens=8, regex=CODE, think=True, think_budget=12, think_end=MARKER, temperature=1.0)
        s += " Done."
    interp, engine, tok = _run(tiny_tok, program, 8)
    marker = tok.encode(MARKER, add_special_tokens=False)
    unconstrained = 0
    for run in interp.runs:
        s = run.state
        meta = s.meta("code")
        assert run.error is None and re.fullmatch(CODE, s["code"]), s["code"]
        assert meta["think_tokens"] == 12 + len(marker)         # a random model never writes the marker
        assert len(tok.encode(meta["thinking"], add_special_tokens=False)) >= 6
        unconstrained += not re.fullmatch(r"x?[0-9]*", meta["thinking"])
        assert not meta["incomplete"]
        # the thinking's KV is cached: the prompt, the thinking and the marker are one cached prefix
        prompt, out = outputs[run.instance.id]
        assert out[12:12 + len(marker)] == marker and tok.decode(out[:12]) == meta["thinking"]
        assert engine.match_len(prompt + out[:12 + len(marker)]) == len(prompt) + 12 + len(marker)
    assert unconstrained >= 6           # the thinking was not held to the grammar


def test_no_marker_in_the_tokenizer_is_one_line(tiny_tok, tmp_path):
    f = tmp_path / "think.py"
    f.write_text("from lmbatch.frontend import gen\n"
                 "def instances():\n    return [{'id': 'first'}]\n"
                 "def program(s):\n    s += 'x'\n    s += gen('g', think=True, regex='[0-9]+')\n")
    r = CliRunner().invoke(app, ["run", str(f), "--model", str(tiny_tok), "--out", str(tmp_path), "--quiet"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == ["error: instance first: gen 'g': think=True: the tokenizer has no </think> marker (no such "
                     "token, not in its chat template); pass think_end='...'"], r.stderr


@pytest.mark.parametrize("task", ["json", "json,mmlu"])
def test_a_run_level_think_budget_without_a_marker_names_the_runs_option(tiny_tok, tmp_path, task):
    """Issue 47 (8d): `--think-budget` on a model without </think> asked for think_end='...' (a program's
    argument) where the user can only pass --think-end; a task alone or in a suite."""
    args = ["run", task, "--limit", "1", "--think-budget", "4", "--model", str(tiny_tok), "--out", str(tmp_path),
            "--quiet"] + (["--subjects", "anatomy"] if "mmlu" in task else [])
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].endswith(": --think-budget: the tokenizer has no </think> marker (no such "
                                                 "token, not in its chat template); pass --think-end MARKER"), lines
    assert "think_end=" not in lines[0]


def test_run_level_think_budget_for_a_built_in_task(tiny_tok, tmp_path):
    """`lmbatch run json --think-budget 6` on a model whose chat template names </think>: every gen
    thinks first (six tokens and the marker, then its JSON)."""
    import json
    import shutil

    from lmbatch.options import RunOptions
    from lmbatch.run.run import run

    model = tmp_path / "thinker"
    shutil.copytree(tiny_tok, model)
    tok = AutoTokenizer.from_pretrained(str(model))
    tok.chat_template += "{# a thinking model closes its thoughts with </think> #}"
    tok.save_pretrained(model)
    marker = len(AutoTokenizer.from_pretrained(str(model)).encode(MARKER, add_special_tokens=False))
    d = run(RunOptions.of(task="json", limit=3, model=str(model), out=tmp_path, run_id="t", device="cpu", quiet=True,
                       think_budget=6))
    summary = json.loads((d / "summary.json").read_text())
    assert summary["counts"]["instances"] == 3 and summary["counts"]["failed_instances"] == 0
    assert summary["tokens"]["decode"] >= 3 * (6 + marker)
    assert summary["options"]["think_budget"] == 6
    assert summary["tokens"]["thinking"] == 3 * (6 + marker)
