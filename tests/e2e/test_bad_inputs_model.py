"""Broken model folders and a program file whose instances() raises, as users met them: `lmbatch run`
prints one line, `error: ...`, exits with code 2 and shows no traceback; a broken model folder is
refused before the task's data is loaded. Each case runs the console script in a child process (its
real stderr and exit code); a small random Llama with a trained tokenizer is built once and copied."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest
from conftest import make_tiny_with_tokenizer

# the task: one instance, whose loading leaves a mark next to the program file
PROGRAM = '''from pathlib import Path
from lmbatch.frontend import select

def instances():
    Path(__file__).with_name("instances-called").touch()
    return [{"id": "a", "text": "The answer is"}]

def program(s, text):
    s += text + select("c", [" yes", " no"])
'''
RAISING = '''def instances():
    raise ValueError("boom")

def program(s):
    pass
'''


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return make_tiny_with_tokenizer(tmp_path_factory.mktemp("good"), 2048)


def _config(**changes):
    def edit(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return edit


def _weights(make):
    def edit(d):
        (d / "model.safetensors").write_bytes(make((d / "model.safetensors").read_bytes()))
    return edit


def _no_weights(d):
    (d / "model.safetensors").unlink()


def _no_tokenizer(d):
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (d / f).unlink(missing_ok=True)


def _not_json(d):
    (d / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,')


CASES = {   # id: (how the good folder is broken, what the one line says after "model at DIR")
    "layers-not-int": (_config(num_hidden_layers="thirty"),
                       ": config.json: num_hidden_layers must be an integer, got 'thirty'"),
    "no-hidden-size": (_config(hidden_size=None), ": config.json: hidden_size is missing"),
    "no-safetensors": (_no_weights, " has no *.safetensors weights"),
    "truncated-header": (_weights(lambda b: b[:100]),
                         ": model.safetensors is not a readable safetensors file (its header length"),
    "truncated-data": (_weights(lambda b: b[:len(b) // 2]),
                       ": model.safetensors is not a readable safetensors file (its tensors need"),
    "random-bytes": (_weights(lambda b: random.Random(0).randbytes(len(b))),
                     ": model.safetensors is not a readable safetensors file ("),
    "git-lfs-pointer": (_weights(lambda b: b"version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 9\n"),
                        ": model.safetensors is not a readable safetensors file (it is a Git LFS pointer"),
    "no-tokenizer": (_no_tokenizer, " has no tokenizer files (tokenizer.json or tokenizer_config.json)"),
    "config-not-json": (_not_json, ": config.json is not readable JSON ("),
}


def _run(task, model, out):
    cmd = [sys.executable, "-c", "from lmbatch.cli import main; main()", "run", str(task), "--model", str(model),
           "--device", "cpu", "--limit", "1", "--out", str(out), "--run-id", "r", "--quiet"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _one_error_line(res) -> str:
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[-1].startswith("error: "), res.stderr
    assert not res.stdout.strip(), res.stdout
    return lines[0]


@pytest.mark.parametrize("case", list(CASES))
def test_broken_model_folder_is_one_line_before_the_data(good, tmp_path, case):
    break_it, says = CASES[case]
    model = tmp_path / "model"
    shutil.copytree(good, model)
    break_it(model)
    (tmp_path / "task.py").write_text(PROGRAM)
    line = _one_error_line(_run(tmp_path / "task.py", model, tmp_path / "out"))
    assert line.startswith((f"error: model at {model}{says}", f"error: model at {model.resolve()}{says}")), line
    assert not (tmp_path / "instances-called").exists(), "the data was loaded before the model was checked"
    assert not (tmp_path / "out" / "r").exists()


def test_program_file_whose_instances_raise(good, tmp_path):
    (tmp_path / "prog.py").write_text(RAISING)
    line = _one_error_line(_run(tmp_path / "prog.py", good, tmp_path / "out"))
    assert line == f"error: {tmp_path / 'prog.py'}: instances() raised ValueError: boom", line


def test_the_good_folder_runs(good, tmp_path):
    """The cases' folder unbroken, and the task: the errors above are theirs alone."""
    (tmp_path / "task.py").write_text(PROGRAM)
    res = _run(tmp_path / "task.py", good, tmp_path / "out")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "instances-called").exists() and (tmp_path / "out" / "r" / "summary.json").is_file()


def test_program_file_whose_instances_are_not_a_list(good, tmp_path):
    (tmp_path / "prog.py").write_text("def instances():\n    return None\n\ndef program(s):\n    pass\n")
    line = _one_error_line(_run(tmp_path / "prog.py", good, tmp_path / "out"))
    assert line == f"error: {tmp_path / 'prog.py'}: instances() must return a list of dicts, got NoneType", line
