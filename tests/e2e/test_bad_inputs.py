"""Bad inputs (issue 36, item 7): CLI options, run ids and run directories, program files, report and
compare. Each case is one table row; each must end with exit code 2 and exactly one line on stderr,
`error: ...`, naming the input, with no traceback; nothing may appear, change or go anywhere in the
folder around --out (program files and other inputs included), and an earlier complete run in the
same --out stays byte-identical. Model folders are tests/e2e/test_bad_inputs_model.py's.

Then the data-loss scenarios the issue found: `--run-id . --overwrite` (it deleted all of --out), an
absolute run id with --overwrite (it deleted a file elsewhere), and two runs on one run id at once
(the first to finish deleted the other's parts)."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import pytest
from conftest import make_tiny_with_tokenizer
from typer.testing import CliRunner

from lmbatch.cli import app


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_with_tokenizer(tmp_path_factory.mktemp("tiny"), 2048)


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    """Caches out of the watched folder, and out of the user's."""
    monkeypatch.setenv("LMBATCH_CACHE", str(tmp_path_factory.getbasetemp() / "bad-inputs-cache"))


def lmbatch(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def run_args(model, out, run_id, *extra, task="mmlu"):
    subjects = ["--subjects", "anatomy"] if task == "mmlu" else []
    return ["run", task, "--limit", 1, *subjects, "--model", model, "--out", out, "--run-id", run_id, "--quiet",
            *extra]


@pytest.fixture(scope="module")
def earlier(tiny, tmp_path_factory):
    """A complete run (copied into every case's --out as `earlier`)."""
    out = tmp_path_factory.mktemp("earlier")
    r = lmbatch(*run_args(tiny, out, "earlier"))
    assert r.exit_code == 0, r.output
    return out / "earlier"


class Env(NamedTuple):
    root: Path          # the watched folder: --out, the inputs and the working directory are inside it
    out: Path
    inputs: Path
    tiny: Path
    closers: list       # what a case holds open until it ends

    def program(self, name: str, text: str) -> Path:
        f = self.inputs / name
        f.write_text(text)
        return f

    def run(self, *extra, task="mmlu", run_id="new"):
        return run_args(self.tiny, self.out, run_id, *extra, task=task)

    def variant(self, name: str, edit: Callable[[dict], None]) -> Path:
        """A copy of the earlier run whose summary.json `edit` changed (its Parquet files stay whole)."""
        d = self.out / name
        shutil.copytree(self.out / "earlier", d)
        s = json.loads((d / "summary.json").read_text())
        edit(s)
        (d / "summary.json").write_text(json.dumps(s))
        return d


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under root, with each file's SHA-256 (a folder: 'dir', a link: its target)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


PROGRAM = ("from lmbatch.frontend import select\n"
           "def instances():\n    return [{'id': 'a', 'text': 'The answer is'}]\n"
           "def program(s, text):\n    s += text + select('c', [' yes', ' no'])\n")


def _set(dotted: str, value):
    def edit(s):
        *path, last = dotted.split(".")
        for key in path:
            s = s[key]
        s[last] = value
    return edit


def _del(key: str):
    return lambda s: s.pop(key)


def _truncate(f: Path) -> Path:
    f.write_bytes(f.read_bytes()[:-40])
    return f


def _incomplete(e: Env, name: str, run_json: str) -> Path:
    d = e.out / name
    (d / "parts").mkdir(parents=True)
    (d / "INCOMPLETE").write_text("")
    (d / "run.json").write_text(run_json)
    return d


def _locked(e: Env):
    """A run directory another run holds (its lock taken here, on a file description of its own)."""
    d = e.out / "busy"
    d.mkdir()
    fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT)
    os.write(fd, b"4242\n")
    fcntl.flock(fd, fcntl.LOCK_EX)
    e.closers.append(lambda: os.close(fd))
    return e.run(run_id="busy"), ["busy", "in use by another run (process 4242)"]


def _linked(e: Env):
    (e.root / "elsewhere").mkdir()
    (e.root / "elsewhere" / "keep.txt").write_text("keep")
    (e.out / "link").symlink_to(e.root / "elsewhere")
    return e.run("--overwrite", run_id="link"), ["link", "symbolic link"]


def _foreign_file_in_a_run(e: Env):
    (e.out / "earlier2").mkdir()
    for f in (e.out / "earlier").iterdir():
        shutil.copy(f, e.out / "earlier2" / f.name)
    (e.out / "earlier2" / "notes.txt").write_text("mine")
    return e.run("--overwrite", run_id="earlier2"), ["earlier2", "holds notes.txt", "no lmbatch run writes"]


def _not_a_run(overwrite: bool):
    def case(e: Env):
        (e.out / "mine").mkdir()
        (e.out / "mine" / "data.csv").write_text("1,2\n")
        extra = ["--overwrite"] if overwrite else []
        return e.run(*extra, run_id="mine"), ["mine", "is not an lmbatch run directory", "data.csv"]
    return case


def _embedded_model_cache_under_a_file(e: Env, monkeypatch):
    (e.inputs / "cachefile").write_text("not a folder")
    monkeypatch.setenv("LMBATCH_CACHE", str(e.inputs / "cachefile"))
    args = e.run()
    i = args.index("--model")
    return args[:i] + args[i + 2:], ["cachefile", "LMBATCH_CACHE"]


def _report_compare(*extra):
    def case(e: Env):
        return ["report", "--compare", e.out / "earlier", e.out / "earlier", *extra], [str(extra[0]), str(extra[1])]
    return case


def _compare_with(name: str, edit, needles):
    def case(e: Env):
        return ["report", "--compare", e.out / "earlier", e.variant(name, edit)], ["cannot compare", *needles]
    return case


def _report_of(name: str, edit, needles):
    def case(e: Env):
        return ["report", e.variant(name, edit)], [name, *needles]
    return case


def _report_files(name: str, alter, needles):
    def case(e: Env):
        d = e.variant(name, lambda s: None)
        alter(d)
        return ["report", d], [name, *needles]
    return case


def _other_instances(e: Env):
    """A copy of the earlier run over other instances (its ids changed), its files recorded as a run records
    them: the same workload by its summary, other instances by its instances.parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lmbatch.rundir.records import FileRecord

    d = e.variant("oi", lambda s: None)
    f = d / "instances.parquet"
    t = pq.read_table(f)
    pq.write_table(t.set_column(t.schema.get_field_index("id"), "id", pa.array([i + "x" for i in
                                                                                 t.column("id").to_pylist()])), f)
    s = json.loads((d / "summary.json").read_text())
    s["files"]["instances.parquet"] = FileRecord.of(f, t.num_rows).to_json()
    (d / "summary.json").write_text(json.dumps(s))
    return ["report", "--compare", e.out / "earlier", d], ["cannot compare", "ran different instances",
                                                            "1 instance only in base, e.g. id 'anatomy/0'"]


def _run_dir_is_a_file(e: Env):
    (e.out / "earlier-file").write_text("x")
    return e.run(run_id="earlier-file")


def _report_summary_bytes(name: str, data: bytes):
    def case(e: Env):
        d = e.variant(name, lambda s: None)
        (d / "summary.json").write_bytes(data)
        return ["report", d]
    return case


BAD_REGEX = ("from lmbatch.frontend import gen\n"
             "def instances():\n    return [{'id': 'a'}]\n"
             "def program(s):\n    s += 'Code:' + gen('g', max_tokens=3, regex='[a-')\n")


def _drop_files_record(d: Path):
    s = json.loads((d / "summary.json").read_text())
    del s["files"]
    (d / "summary.json").write_text(json.dumps(s))
    _truncate(d / "requests.parquet")


# Each case: (id, what makes its arguments, what the one line must hold). A case function may take
# monkeypatch too.
CASES: list[tuple[str, Callable, list[str]]] = [
    # ---- options of `lmbatch run` -------------------------------------------------------------------
    ("shots-negative", lambda e: e.run("--shots", -1), ["--shots"]),
    ("shots-too-many", lambda e: e.run("--shots", 6), ["--shots 6"]),
    ("limit-zero", lambda e: e.run("--limit", 0), ["--limit"]),
    ("subject-unknown", lambda e: e.run("--subjects", "astrology"), ["astrology"]),
    ("subjects-on-json", lambda e: e.run("--subjects", "anatomy", task="json"), ["--subjects", "json"]),
    ("device", lambda e: e.run("--device", "tpu"), ["--device tpu"]),
    ("dtype", lambda e: e.run("--dtype", "int4"), ["--dtype int4"]),
    ("float16-on-cpu", lambda e: e.run("--device", "cpu", "--dtype", "float16"), ["float16", "CPU"]),
    ("attention", lambda e: e.run("--attention", "magic"), ["--attention magic"]),
    ("schedule", lambda e: e.run("--schedule", "lifo"), ["--schedule lifo"]),
    ("max-tokens-per-batch", lambda e: e.run("--max-tokens-per-batch", 0), ["--max-tokens-per-batch"]),
    ("kv-cache-tokens", lambda e: e.run("--kv-cache-tokens", 0), ["--kv-cache-tokens"]),
    ("checkpoint-s", lambda e: e.run("--checkpoint-s", 0), ["--checkpoint-s"]),
    ("tensor-parallel", lambda e: e.run("--tensor-parallel", 0), ["--tensor-parallel"]),
    ("data-parallel", lambda e: e.run("--data-parallel", "many"), ["--data-parallel many"]),
    ("think-budget-on-mmlu", lambda e: e.run("--think-budget", 8), ["--think-budget", "mmlu", "generates no"]),
    ("no-jump-forward-on-hellaswag", lambda e: e.run("--no-jump-forward", task="hellaswag"),
     ["--no-jump-forward", "hellaswag"]),
    ("think-end-alone", lambda e: e.run("--think-end", "</t>", task="json"), ["--think-end"]),
    ("think-budget-negative", lambda e: e.run("--think-budget", -1, task="json"), ["--think-budget"]),
    ("chat-template-on-json", lambda e: e.run("--apply-chat-template", task="json"), ["--apply-chat-template"]),
    ("multiturn-without-chat", lambda e: e.run("--fewshot-as-multiturn"), ["--fewshot-as-multiturn"]),
    ("unknown-task", lambda e: ["run", "mmlux", "--out", e.out], ["mmlux"]),
    ("out-empty", lambda e: ["run", "mmlu", "--out", "", "--limit", 1], ["--out is empty"]),
    # issue 47 (8b): `--model ''` named '.', the current folder
    ("model-empty", lambda e: ["run", "mmlu", "--model", "", "--out", e.out, "--limit", 1], ["--model ''", "is empty"]),
    ("out-is-a-file", lambda e: run_args(e.tiny, e.out / "earlier" / "summary.json", "x"), ["--out", "is a file"]),
    ("out-under-a-file", lambda e: run_args(e.tiny, e.out / "earlier" / "summary.json" / "sub", "x"),
     ["--out", "not writable"]),
    ("embedded-model-cache-under-a-file", _embedded_model_cache_under_a_file, ["LMBATCH_CACHE"]),
    # ---- run ids: one folder name inside --out --------------------------------------------------------
    ("run-id-empty", lambda e: e.run(run_id=""), ["--run-id ''", "is empty"]),
    ("run-id-blank", lambda e: e.run(run_id="  "), ["--run-id '  '", "is empty"]),
    ("run-id-dot", lambda e: e.run("--overwrite", run_id="."), ["--run-id '.'"]),
    ("run-id-dotdot", lambda e: e.run(run_id=".."), ["--run-id '..'"]),
    ("run-id-escapes", lambda e: e.run(run_id="../escaped"), ["'../escaped'", "climbs out of --out"]),
    ("run-id-nested", lambda e: e.run(run_id="a/b"), ["'a/b'", "path separator"]),
    ("run-id-backslash", lambda e: e.run(run_id="a\\b"), ["a\\\\b", "path separator"]),
    ("run-id-absolute", lambda e: e.run("--overwrite", run_id=str(e.root / "abs")), ["abs", "absolute path"]),
    ("run-id-control", lambda e: e.run(run_id="a\x07b"), ["'a\\x07b'", "control character"]),
    ("run-id-newline", lambda e: e.run(run_id="a\nb"), ["'a\\nb'", "control character"]),
    ("run-id-too-long", lambda e: e.run(run_id="x" * 201), ["201 bytes", "more than 200"]),
    ("run-id-hidden", lambda e: e.run(run_id=".earlier.old-1"), ["'.earlier.old-1'", "starts with '.'"]),
    # ---- run directories ------------------------------------------------------------------------------
    ("complete-run-without-overwrite", lambda e: e.run(run_id="earlier"), ["earlier", "exists", "--overwrite"]),
    ("not-a-run-with-overwrite", _not_a_run(True), ["--overwrite replaces only run directories"]),
    ("not-a-run", _not_a_run(False), ["pass another --run-id"]),
    ("foreign-file-in-a-run", _foreign_file_in_a_run, []),
    ("run-dir-is-a-link", _linked, []),
    ("run-dir-is-a-file", _run_dir_is_a_file, ["earlier-file", "is a file"]),
    ("run-dir-in-use", _locked, []),
    ("incomplete-other-settings", lambda e: _incomplete(e, "inc", json.dumps({"fingerprint": {"task": "x"}}))
     and e.run(run_id="inc"), ["inc", "other settings", "differ"]),
    ("incomplete-run-json-unreadable", lambda e: _incomplete(e, "inc", "{half") and e.run(run_id="inc"),
     ["inc", "no readable run.json"]),
    # ---- program files --------------------------------------------------------------------------------
    ("program-missing", lambda e: e.run(task=e.inputs / "nope.py"), ["nope.py", "does not exist"]),
    ("program-syntax", lambda e: e.run(task=e.program("syn.py", "def program(s:\n")), ["syn.py", "SyntaxError"]),
    ("program-without-program", lambda e: e.run(task=e.program("np.py", "def instances():\n    return []\n")),
     ["np.py", "`program`"]),
    ("program-without-instances", lambda e: e.run(task=e.program("ni.py", "def program(s):\n    pass\n")),
     ["ni.py", "`instances`"]),
    ("instances-raise", lambda e: e.run(task=e.program("ir.py", PROGRAM.replace(
        "return [", "raise ValueError('boom')\n    return ["))), ["ir.py", "instances() raised ValueError: boom"]),
    ("instances-not-a-list", lambda e: e.run(task=e.program("il.py", PROGRAM.replace(
        "return [{'id': 'a', 'text': 'The answer is'}]", "return 7"))), ["il.py", "got int"]),
    ("instances-not-dicts", lambda e: e.run(task=e.program("id.py", PROGRAM.replace(
        "return [{'id': 'a', 'text': 'The answer is'}]", "return ['a']"))), ["id.py", "item 0 is a str"]),
    ("exit-at-import", lambda e: e.run(task=e.program("xi.py", "import sys\nsys.exit(3)\n" + PROGRAM)),
     ["xi.py", "called sys.exit(3) while it was imported"]),
    ("exit-in-instances", lambda e: e.run(task=e.program("xn.py", "import sys\n" + PROGRAM.replace(
        "return [", "sys.exit()\n    return ["))), ["xn.py", "instances() called sys.exit()"]),
    ("exit-in-program", lambda e: e.run(task=e.program("xp.py", "import sys\n" + PROGRAM.replace(
        "s += text", "sys.exit('bye')\n    s += text"))), ["instance a", "called sys.exit('bye')"]),
    ("program-raises", lambda e: e.run(task=e.program("pr.py", PROGRAM.replace(
        "s += text", "raise KeyError('k')\n    s += text"))), ["instance a", "KeyError"]),
    ("program-bad-regex", lambda e: e.run(task=e.program("rx.py", BAD_REGEX)), ["instance a", "regex"]),
    ("subjects-on-a-program", lambda e: e.run("--subjects", "anatomy", task=e.program("sp.py", PROGRAM)),
     ["--subjects", "sp"]),
    # ---- report and compare ---------------------------------------------------------------------------
    ("report-missing", lambda e: ["report", e.out / "nothing"], ["nothing", "not an lmbatch run directory"]),
    ("report-no-summary", lambda e: (e.out / "empty").mkdir() or ["report", e.out / "empty"],
     ["empty", "no summary.json"]),
    ("report-not-json", _report_summary_bytes("nj", b"{half"), ["nj", "not valid JSON"]),
    ("report-not-utf8", _report_summary_bytes("nu", b'{"run_id": "\xff"}'), ["nu", "not UTF-8"]),
    ("report-a-list", _report_summary_bytes("nl", b"[]"), ["nl", "JSON object"]),
    ("report-hit-rate-a-string", _report_of("hr", _set("hit_rate", "0.9"), ["'hit_rate'", "'0.9'", "not a number"]),
     []),
    ("report-instances-a-string", _report_of("ni", _set("counts.instances", "2"), ["'counts.instances'"]), []),
    ("report-throughput-a-list", _report_of("tl", _set("throughput", []), ["'throughput'", "not an object"]), []),
    ("report-metric-a-string", _report_of("ms", _set("metrics.acc_norm", "high"), ["'metrics.acc_norm'"]), []),
    ("report-missing-field", _report_of("mf", _del("hit_rate"), ["lacks field 'hit_rate'"]), []),
    ("report-incomplete", lambda e: ["report", _incomplete(e, "inc", "{}")], ["inc", "incomplete run"]),
    ("report-truncated", _report_files("tr", lambda d: _truncate(d / "instances.parquet"),
                                       ["instances.parquet", "does not belong"]), []),
    ("report-truncated-no-record", _report_files("tn", _drop_files_record,
                                                 ["requests.parquet", "not a whole Parquet file"]), []),
    ("compare-with-a-positional", lambda e: ["report", e.out / "earlier", "--compare", e.out / "earlier",
                                             e.out / "earlier"], ["--compare", "earlier"]),
    ("compare-shots", _compare_with("s5", _set("options.shots", 5), ["shots 0 vs 5"]), []),
    ("compare-model", _compare_with("om", _set("model", "/models/Other-1B"), ["model", "'Other-1B'"]), []),
    ("compare-dtype", _compare_with("bf", _set("dtype", "bfloat16"), ["dtype 'float32' vs 'bfloat16'"]), []),
    ("compare-subjects", _compare_with("vi", _set("options.subjects", ["virology"]), ["subjects"]), []),
    ("compare-chat", _compare_with("ch", _set("options.apply_chat_template", True), ["apply_chat_template"]), []),
    ("max-slowdown-negative", _report_compare("--max-slowdown", -1), []),
    ("min-hit-ratio-above-1", _report_compare("--min-hit-ratio", 1.5), []),
    ("max-acc-drop-nan", _report_compare("--max-acc-drop", "nan"), []),
    ("alpha-above-1", _report_compare("--alpha", 2), []),
    ("compare-other-instances", _other_instances, []),
    ("html-in-a-missing-folder", lambda e: ["report", e.out / "earlier", "--html", e.out / "nowhere" / "r.html"],
     ["--html", "nowhere", "does not exist"]),
    ("html-a-folder", lambda e: ["report", e.out / "earlier", "--html", e.out], ["--html", "name a file"]),
    ("report-format", lambda e: ["report", e.out / "earlier", "--format", "html"], ["'html'"]),
    ("report-nothing", lambda e: ["report"], ["give one or more run directories"]),
]


def _resolve(case: Callable, e: Env, monkeypatch) -> tuple[list, list[str]]:
    import inspect

    made = case(e, monkeypatch) if len(inspect.signature(case).parameters) == 2 else case(e)
    if isinstance(made, tuple):      # the case says its needles itself
        return made
    return made, []


@pytest.mark.parametrize("case,needles", [(c, n) for _, c, n in CASES], ids=[i for i, _, _ in CASES])
def test_a_bad_input_is_one_line_and_touches_nothing(tiny, earlier, tmp_path, monkeypatch, case, needles):
    root = tmp_path / "area"
    e = Env(root, root / "out", root / "inputs", tiny, [])
    for d in (e.out, e.inputs, root / "cwd"):
        d.mkdir(parents=True)
    shutil.copytree(earlier, e.out / "earlier")
    monkeypatch.chdir(root / "cwd")
    args, own = _resolve(case, e, monkeypatch)
    before = _snapshot(root)
    try:
        r = lmbatch(*args)
    finally:
        for close in e.closers:
            close()
    assert r.exit_code == 2, r.output
    assert isinstance(r.exception, SystemExit), r.exception       # no other exception escaped
    assert "Traceback" not in r.output
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles + own:
        assert n in lines[0], (n, lines[0])
    assert _snapshot(root) == before


def test_the_table_holds_forty_bad_inputs():
    assert len(CASES) >= 40 and len({i for i, _, _ in CASES}) == len(CASES)


# ---- data loss (issue 36) ----------------------------------------------------------------------------------

def test_run_id_dot_with_overwrite_leaves_out_alone(tiny, earlier, tmp_path):
    """`--run-id . --overwrite` took --out itself as the run directory and deleted all of it."""
    out = tmp_path / "out"
    shutil.copytree(earlier, out / "earlier")
    (out / "notes.txt").write_text("mine")
    before = _snapshot(tmp_path)
    for run_id in (".", "", "..", str(out), str(tmp_path / "elsewhere")):
        r = lmbatch(*run_args(tiny, out, run_id, "--overwrite"))
        assert r.exit_code == 2 and "--run-id" in r.stderr, r.output
    assert _snapshot(tmp_path) == before


def test_overwrite_replaces_a_run_and_only_its_files(tiny, earlier, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(earlier, out / "earlier")
    (out / "notes.txt").write_text("mine")
    r = lmbatch(*run_args(tiny, out, "earlier", "--overwrite", "--schedule", "random"))
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["earlier", "notes.txt"]
    assert sorted(p.name for p in (out / "earlier").iterdir()) == ["instances.parquet", "requests.parquet",
                                                                   "summary.json"]
    assert json.loads((out / "earlier" / "summary.json").read_text())["options"]["schedule"] == "random"


# a run held before its second part until the file named by its first argument exists
SLOW = ("import sys, time\nfrom pathlib import Path\nfrom lmbatch.rundir import rundir\n"
        "parts, go = [], Path(sys.argv[1])\n"
        "def hold(step):\n"
        "    if step == 'part requests':\n"
        "        parts.append(step)\n"
        "        if len(parts) == 2:\n"
        "            Path(str(go) + '.held').touch()\n"
        "            while not go.exists():\n"
        "                time.sleep(0.05)\n"
        "rundir.fault = hold\n"
        "from lmbatch.cli import main\nsys.argv = ['lmbatch'] + sys.argv[2:]\nmain()\n")


def test_a_second_run_on_the_same_run_id_is_refused_while_the_first_writes(tiny, tmp_path):
    """Two runs on one run id: the second says in one line that the folder is another run's, and touches
    nothing; the first, held after its first part, then completes as if alone."""
    out, go = tmp_path / "out", tmp_path / "go"
    args = ["run", "mmlu", "--shots", 1, "--limit", 2, "--subjects", "anatomy", "--subjects", "virology",
            "--subjects", "astronomy", "--model", tiny, "--out", out, "--run-id", "shared", "--device", "cpu",
            "--quiet", "--checkpoint-s", 1e-6, "--max-tokens-per-batch", 64]
    first = subprocess.Popen([sys.executable, "-c", SLOW, str(go), *map(str, args)], stderr=subprocess.PIPE,
                             text=True)
    try:
        held = tmp_path / "go.held"     # the first part and its run.json written, the second part not begun
        t = time.time()
        while not held.exists():
            assert first.poll() is None, first.stderr.read() if first.stderr else ""
            assert time.time() - t < 120
            time.sleep(0.05)
        before = _snapshot(out)
        for extra in ([], ["--overwrite"]):
            r = lmbatch(*args, *extra)
            assert r.exit_code == 2, r.output
            lines = r.stderr.splitlines()
            assert len(lines) == 1 and "shared is in use by another run (process " in lines[0], r.stderr
            assert f"(process {first.pid})" in lines[0] and "disk" not in lines[0]
        assert _snapshot(out) == before
        go.touch()
        _, err = first.communicate(timeout=300)
        assert first.returncode == 0, err
    finally:
        if first.poll() is None:
            first.kill()
    s = json.loads((out / "shared" / "summary.json").read_text())
    assert s["counts"]["instances"] == 6 and s["counts"]["resumed_instances"] == 0
    assert sorted(p.name for p in (out / "shared").iterdir()) == ["instances.parquet", "requests.parquet",
                                                                  "summary.json"]
