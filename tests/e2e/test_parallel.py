"""Data parallelism (issue 23) on CPU: `--data-parallel 2` runs two worker processes, each with its
own copy of the model and its own parts of the radix tree, and must give what one process gives:
the same instances in the same order, the same predictions, generated text and scores (logprobs to
float32 batching noise), with the hit rate the partition's plan says and each multi-stage program
on one worker."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import make_tiny_hf, make_tiny_with_tokenizer

from lmbatch.engine.options import EngineOptions, EngineSpec
from lmbatch.engine.parallel import ParallelEngine
from lmbatch.engine.worker import Finished
from lmbatch.errors import WorkerFailed
from lmbatch.model.config import ModelConfig
from lmbatch.options import RunOptions
from lmbatch.run.run import run

# two stages: a sampled gen (seeded by its instance), then a select after the generated text
PROGRAM = '''from lmbatch.frontend import gen, select

def instances():
    return [{"id": f"q{k}", "n": k} for k in range(10)]

def program(s, n):
    s += f"Question {n}: what comes after {n}?"
    s += gen("thought", max_tokens=8, temperature=0.8)
    s += " So the answer is" + select("answer", [" one", " two", " three"])
'''

CASES = {
    "mmlu": dict(task="mmlu", shots=5, limit=2, subjects=["anatomy", "virology", "astronomy"]),
    "program": dict(task="PROGRAM"),
    "json": dict(task="json", limit=3),         # grammar-constrained: each worker compiles the schemas
    # seven waves of sampled generation and judging, each program's later calls on the worker of its earlier
    "tot": dict(task="tot-gsm8k", limit=3, model="TINY"),
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_with_tokenizer(tmp_path_factory.mktemp("tiny") / "m", 16384)


def _run(tmp_path, case: str, workers: int, program_path, model=None) -> tuple[list[dict], dict, list[dict]]:
    kw = dict(CASES[case])
    if kw["task"] == "PROGRAM":
        kw["task"] = str(program_path)
    if kw.get("model") == "TINY":
        kw["model"] = str(model)
    d = run(RunOptions.of(**kw, out=tmp_path, run_id=f"{case}-{workers}", device="cpu", quiet=True,
                       data_parallel=str(workers), checkpoint_s=1e-6, max_tokens_per_batch=256))
    return (pq.read_table(d / "instances.parquet").to_pylist(), json.loads((d / "summary.json").read_text()),
            pq.read_table(d / "requests.parquet").to_pylist())


@pytest.fixture(scope="module")
def program_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("prog") / "two_stage.py"
    path.write_text(PROGRAM)
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_two_workers_give_one_process_results(case, tmp_path, program_path, tiny_model):
    one, s1, _ = _run(tmp_path, case, 1, program_path, tiny_model)
    two, s2, reqs = _run(tmp_path, case, 2, program_path, tiny_model)
    assert [r["id"] for r in two] == [r["id"] for r in one]
    for a, b in zip(two, one):
        assert (a["prediction"], a["correct"], a["error"]) == (b["prediction"], b["correct"], b["error"]), a["id"]
        assert json.loads(a["outputs"]) == json.loads(b["outputs"]), a["id"]
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4), a["id"]
        assert a["prompt_tokens"] == b["prompt_tokens"]
    assert s2["accuracy"] == s1["accuracy"] and s2["metrics"] == s1["metrics"]
    assert s1["data_parallel"] == {"workers": 1, "tensor_parallel": 1, "why": "--tensor-parallel auto: 1 on CPU",
                                   "duplicated_tokens": 0,
                                   "optimal_hit_rate": s1["optimal_hit_rate"]}
    dp = s2["data_parallel"]
    assert dp["workers"] == 2 and dp["duplicated_tokens"] >= 0
    # each worker's load: every computed token counted once, by the worker that computed it
    load = dp["workers_load"]
    assert len(load) == 2 and all(w["busy_s"] > 0 and w["idle_s"] >= 0 and w["chunks"] >= 1 for w in load)
    assert sum(w["computed_tokens"] for w in load) == s2["tokens"]["computed"]
    assert s2["tokens"]["prompt"] == s1["tokens"]["prompt"]
    assert s2["tokens"]["computed"] + s2["tokens"]["cached"] == s2["tokens"]["prompt"]
    # each worker's optimum over what it executed: no run beats it, and two workers reach less than one
    assert s2["hit_rate"] <= dp["optimal_hit_rate"] + 1e-12
    assert dp["optimal_hit_rate"] <= s2["optimal_hit_rate"] + 1e-12
    if case == "mmlu":      # one wave of scoring: each worker reaches its part's optimum exactly
        assert s1["hit_rate"] == pytest.approx(s1["optimal_hit_rate"], abs=1e-12)
        assert s2["hit_rate"] == pytest.approx(dp["optimal_hit_rate"], abs=1e-12)
        assert s2["tokens"]["computed"] == s1["tokens"]["computed"] + dp["duplicated_tokens"]
        # the cut duplicates under 1%; a chunk an idle worker takes from the other's share (how many depends
        # on the machine's load) adds at most the path down to its first subtree: a prompt's length
        taken = sum(w["chunks_taken"] for w in load)
        longest = max(r["prompt_tokens"] for r in reqs)
        assert dp["duplicated_tokens"] < s1["tokens"]["prompt"] * 0.01 + taken * longest, (taken, longest)
    if case in ("program", "json", "tot"):     # programs that generate ran whole on their worker (run/spread.py)
        assert [w["chunks"] for w in load] == [1, 1]
        assert s2["counts"]["waves"] >= 1 and s2["counts"]["calls"] == s1["counts"]["calls"]
        assert s2["counts"]["requests"] == s1["counts"]["requests"]
        assert s2["tokens"]["decode"] == s1["tokens"]["decode"]
        # the run's optimum is every executed prompt's, as one engine's; the workers' own is their sum's
        assert s2["optimal_hit_rate"] == s1["optimal_hit_rate"]
        assert s2["tokens"]["unique"] == s1["tokens"]["unique"]
        assert sorted(r["order"] for r in reqs) == list(range(len(reqs)))
        assert len(reqs) == s2["counts"]["executed_requests"]
    if case == "program":   # the select after each gen found its program's text cached on its worker
        selects = [r for r in reqs if r["kind"] == "select"]
        assert selects and all(r["cached_tokens"] >= r["prompt_tokens"] - 8 for r in selects)


def test_bad_data_parallel_is_one_line(tmp_path):
    for bad in ("0", "two", "-1"):
        p = subprocess.run([sys.executable, "-c", "from lmbatch.cli import main; main()", "run", "mmlu", "--limit",
                            "1", "--out", str(tmp_path), "--data-parallel", bad], capture_output=True, text=True)
        assert p.returncode == 2, p.stderr
        assert p.stderr.strip().splitlines() == [f"error: --data-parallel {bad}: use a number of workers (at least "
                                                 "1) or auto"], p.stderr


def test_tensor_parallel_run_equals_one_process(tmp_path):
    """`lmbatch run --tensor-parallel 2` (gloo on CPU) on a tiny model: MMLU's predictions and scores
    as one process gives them, to float32 reduction order."""
    model = make_tiny_with_tokenizer(tmp_path / "tiny", 2048)
    dirs = [run(RunOptions.of(task="mmlu", shots=2, limit=2, subjects=["anatomy", "virology"], model=str(model),
                           out=tmp_path, run_id=f"tp{t}", device="cpu", quiet=True, tensor_parallel=t))
            for t in (1, 2)]
    one, two = (pq.read_table(d / "instances.parquet").to_pylist() for d in dirs)
    assert [(r["id"], r["prediction"]) for r in two] == [(r["id"], r["prediction"]) for r in one]
    for a, b in zip(two, one):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)
    summary = json.loads((dirs[1] / "summary.json").read_text())
    assert summary["data_parallel"]["tensor_parallel"] == 2
    assert summary["hit_rate"] == pytest.approx(summary["optimal_hit_rate"], abs=1e-12)


def test_a_model_that_does_not_split_is_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-c", "from lmbatch.cli import main; main()", "run", "mmlu", "--limit", "1",
                        "--out", str(tmp_path), "--tensor-parallel", "2", "--device", "cpu"],
                       capture_output=True, text=True)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == ["error: --tensor-parallel 2: 2 ranks do not divide the model's "
                                             "num_heads (9)"], p.stderr


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A Ray head on the loopback address, with room for two one-CPU workers; stopped after."""
    ray = str(Path(sys.executable).parent / "ray")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run([ray, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
                    "--num-gpus=0", "--include-dashboard=false", "--object-store-memory=100000000",
                    "--disable-usage-stats"], check=True, capture_output=True)
    yield f"127.0.0.1:{port}"
    subprocess.run([ray, "stop", "--force"], capture_output=True)


def test_two_workers_on_a_ray_cluster(tmp_path, program_path, ray_head):
    """The same run with its two workers placed by Ray (each connects back to the driver): the
    results of one local process."""
    one, s1, _ = _run(tmp_path, "mmlu", 1, program_path)
    # the driver is a process of its own: Ray 2.60 once aborted its driver on an internal check
    # ("Tried to complete task that was not pending", CI 2026-11-26), which took pytest with it; that
    # abort, and only it, is retried once (over the aborted run's folder)
    args = [sys.executable, "-c", "from lmbatch.cli import main; main()", "run", "mmlu", "--shots", "5", "--limit",
            "2", *[a for subject in CASES["mmlu"]["subjects"] for a in ("--subjects", subject)], "--out",
            str(tmp_path), "--run-id", "ray", "--device", "cpu", "--quiet", "--data-parallel", "2", "--ray-address",
            ray_head, "--checkpoint-s", "1e-6", "--max-tokens-per-batch", "256"]
    for attempt in range(2):
        p = subprocess.run(args, capture_output=True, text=True, timeout=600)
        if p.returncode == 0 or "likely discovered a bug in Ray" not in p.stderr or attempt:
            break
        args.append("--overwrite")
    assert p.returncode == 0, p.stderr[-3000:]
    d = tmp_path / "ray"
    two = pq.read_table(d / "instances.parquet").to_pylist()
    s2 = json.loads((d / "summary.json").read_text())
    assert [(r["id"], r["prediction"]) for r in two] == [(r["id"], r["prediction"]) for r in one]
    for a, b in zip(two, one):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)
    assert s2["accuracy"] == s1["accuracy"] and s2["data_parallel"]["workers"] == 2
    assert s2["hit_rate"] == pytest.approx(s2["data_parallel"]["optimal_hit_rate"], abs=1e-12)


def test_no_ray_cluster_is_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.run([sys.executable, "-c", "from lmbatch.cli import main; main()", "run", "mmlu", "--limit", "1",
                        "--out", str(tmp_path), "--data-parallel", "2", "--device", "cpu", "--quiet",
                        "--ray-address", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith(f"error: --ray-address 127.0.0.1:{port}: no Ray cluster"), \
        p.stderr


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _workers(pid: int) -> list[int]:
    """The data-parallel worker processes of the command `pid` (spawned interpreters)."""
    found = []
    for child in _children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing.spawn" in cmdline or b"spawn_main" in cmdline:
            found.append(child)
    return found


def test_a_worker_killed_mid_run_is_one_line_and_the_run_resumes(tmp_path):
    """A worker killed while the run executes: the command says so in one line (exit 1) and keeps what
    finished; the same command resumes and the run ends with one engine's predictions. Two questions a
    subject (114): the resume computes what the kill left in 16-token batches (the same command), most of
    the test's time."""
    model = make_tiny_with_tokenizer(tmp_path / "tiny", 16384)
    cmd = [sys.executable, "-c", "from lmbatch.cli import main; main()", "run", "mmlu", "--shots", "5", "--limit", "2",
           "--model", str(model), "--out", str(tmp_path), "--device", "cpu", "--quiet", "--checkpoint-s", "1e-6",
           "--max-tokens-per-batch", "16"]
    one = run(RunOptions.of(task="mmlu", shots=5, limit=2, model=str(model), out=tmp_path, run_id="one", device="cpu",
                         quiet=True, data_parallel="1", max_tokens_per_batch=256))
    p = subprocess.Popen(cmd + ["--run-id", "two", "--data-parallel", "2"], stderr=subprocess.PIPE, text=True)
    parts = tmp_path / "two" / "parts"
    deadline = time.monotonic() + 300
    while p.poll() is None and time.monotonic() < deadline and not list(parts.glob("*.instances.parquet")):
        time.sleep(0.05)
    workers = _workers(p.pid)
    assert p.poll() is None and len(workers) == 2, "the run ended before a worker could be killed"
    os.kill(workers[1], signal.SIGKILL)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: data-parallel worker ") and "exited (code -9)" in lines[0] \
        and "the same command resumes" in lines[0], err
    assert (tmp_path / "two" / "INCOMPLETE").exists() or list(parts.glob("*.instances.parquet"))
    again = subprocess.run(cmd + ["--run-id", "two", "--data-parallel", "2"], capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["counts"]["resumed_instances"] > 0 and summary["data_parallel"]["workers"] == 2
    got = pq.read_table(tmp_path / "two" / "instances.parquet").to_pylist()
    want = pq.read_table(one / "instances.parquet").to_pylist()
    assert [(r["id"], r["prediction"]) for r in got] == [(r["id"], r["prediction"]) for r in want]
    for a, b in zip(got, want):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)


def test_auto_is_one_process_on_cpu(tmp_path):
    """Left to auto (the default), a CPU run is one engine in the command's own process, and says why."""
    d = run(RunOptions.of(task="mmlu", limit=1, subjects=["anatomy"], out=tmp_path, run_id="auto", device="cpu",
                       quiet=True))
    s = json.loads((d / "summary.json").read_text())
    assert (s["options"]["data_parallel"], s["options"]["tensor_parallel"]) == ("auto", "auto")
    assert s["data_parallel"]["workers"] == 1 and s["data_parallel"]["tensor_parallel"] == 1
    assert s["data_parallel"]["why"] == "--data-parallel and --tensor-parallel auto: 1 on CPU"
    assert "workers_load" not in s["data_parallel"]


UNPICKLABLE = '''from lmbatch.frontend import gen

def instances():
    return [{"id": f"q{k}", "n": k, "show": lambda x: f"<{x}>"} for k in range(4)]

def program(s, n, show):
    s += show(n) + " next:"
    s += gen("a", max_tokens=4)
    s += " and then:" + gen("b", max_tokens=4)
'''


def test_instances_that_do_not_pickle_run_in_waves(tmp_path, tiny_model):
    """A program file whose instances hold what cannot cross to a worker (a function): the programs run in
    this process's interpreter, each wave cut across the workers, with one engine's results."""
    path = tmp_path / "unpicklable.py"
    path.write_text(UNPICKLABLE)
    got = {}
    for workers in ("1", "2"):
        d = run(RunOptions.of(task=str(path), model=str(tiny_model), out=tmp_path, run_id=f"u{workers}", device="cpu",
                              quiet=True, data_parallel=workers, max_tokens_per_batch=256))
        summary = json.loads((d / "summary.json").read_text())
        got[workers] = (pq.read_table(d / "instances.parquet").to_pylist(), summary)
    assert [r["outputs"] for r in got["2"][0]] == [r["outputs"] for r in got["1"][0]]
    dp = got["2"][1]["data_parallel"]
    assert dp["workers"] == 2 and got["2"][1]["counts"]["instances"] == 4
    assert sum(w["chunks"] for w in dp["workers_load"]) == 4      # two waves, each cut in two (whole programs: 2)


class _Report:
    """A remote work (engine/worker.py `Remote`): one message of its own, then its engine's pool as its result."""

    def run_on(self, engine, send, due):
        send("hello")
        return engine.kv_slots


class _Exit:
    def run_on(self, engine, send, due):
        os._exit(9)


def test_remote_work_runs_on_each_worker_and_a_worker_that_exits_is_named(tmp_path):
    """`ParallelEngine.spread` (how a run's programs go to its workers whole): each worker's messages as they
    come and its result once it ends; a worker that exits meanwhile raises, naming it and its exit code."""
    make_tiny_hf("llama", tmp_path)
    spec = EngineSpec(str(tmp_path), "cpu", "float32", EngineOptions(kv_cache_tokens=512, max_tokens_per_batch=64),
                      data_parallel=2, threads=1)
    engine = ParallelEngine(spec, ModelConfig.from_dir(tmp_path))
    try:
        got = [m for m in engine.spread({0: _Report(), 1: _Report()}, 0.05) if m is not None]
        assert sorted((k, m) for k, m in got if m == "hello") == [(0, "hello"), (1, "hello")]
        assert {k: m.payload for k, m in got if isinstance(m, Finished)} == {0: engine.kv_slots, 1: engine.kv_slots}
        assert not engine.running
        with pytest.raises(WorkerFailed, match=r"^data-parallel worker 1 exited \(code 9\)$"):
            list(engine.spread({0: _Report(), 1: _Exit()}, 0.05))
        assert engine.running       # cut short: `close` ends the workers at once
    finally:
        engine.close()
