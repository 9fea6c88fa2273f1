"""The fixed costs of a run (issue 34): a built-in task's prepared workload is cached (a repeat run reads
back the same token ids and plan, and gives the same results), keyed by everything that changes it; a
cache file that is not whole is made again with one line; and a native run of a built-in task imports
neither transformers nor xgrammar nor FlashInfer, in any of its processes, on a model it has never
seen and on a repeat."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import make_tiny_with_tokenizer

from lmbatch.caches import workloads as workload_cache
from lmbatch.options import RunOptions
from lmbatch.run.run import run


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_with_tokenizer(tmp_path_factory.mktemp("tiny"), 2048)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LMBATCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "workloads"


def _run(tiny, out, run_id, **kw):
    o = dict(shots=2, limit=2, subjects=["anatomy", "virology"], model=str(tiny), out=out, run_id=run_id,
             device="cpu", quiet=True, save_token_ids=True)
    return run(RunOptions.of(task="mmlu", **{**o, **kw}))


def _entries(cache: Path) -> set[str]:
    return {p.name for p in cache.glob("*.pkl")} if cache.is_dir() else set()


def _same(a: Path, b: Path) -> None:
    for name in ("instances.parquet", "requests.parquet"):
        ra, rb = (pq.read_table(d / name).drop_columns(["attempt"] if name == "requests.parquet" else [])
                  .to_pylist() for d in (a, b))
        assert ra == rb, name
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    for key in ("hit_rate", "optimal_hit_rate", "accuracy", "tokens", "counts"):
        assert sa[key] == sb[key], key


def test_a_repeat_reads_the_cached_workload_and_gives_the_same_run(tiny, cache, tmp_path):
    first = _run(tiny, tmp_path, "first")
    assert len(_entries(cache)) == 1
    second = _run(tiny, tmp_path, "second")
    assert len(_entries(cache)) == 1
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (first, second))
    assert s1["workload"] != "cache" and s2["workload"] == "cache"
    _same(first, second)        # token ids (saved), the execution order (the plan), predictions, hit rate
    third = _run(tiny, tmp_path, "third", workload_cache=False)        # --no-workload-cache: prepared again
    assert json.loads((third / "summary.json").read_text())["workload"] != "cache"
    _same(first, third)


@pytest.mark.parametrize("change", ["shots", "subjects", "tokenizer"])
def test_what_changes_a_workload_makes_another_entry(tiny, cache, tmp_path, change):
    model = tmp_path / "model"
    model.mkdir()
    for f in tiny.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    _run(model, tmp_path, "a")
    before = _entries(cache)
    if change == "shots":
        _run(model, tmp_path, "b", shots=1)
    elif change == "subjects":
        _run(model, tmp_path, "b", subjects=["anatomy"])
    else:   # the same tokenizer, its file written otherwise: another entry (keyed by the files' content)
        spec = json.loads((model / "tokenizer.json").read_text())
        (model / "tokenizer.json").write_text(json.dumps(spec, indent=1))
        _run(model, tmp_path, "b")
    assert len(_entries(cache) - before) == 1


def test_the_key_covers_the_data_files_and_the_options(tiny, tmp_path):
    data = tmp_path / "data.arrow"
    data.write_bytes(b"questions")
    base = workload_cache.key({"task": "mmlu", "shots": 5}, [data], tiny)
    assert workload_cache.key({"task": "mmlu", "shots": 5}, [data], tiny) == base
    assert workload_cache.key({"task": "mmlu", "shots": 4}, [data], tiny) != base
    data.write_bytes(b"questions, edited")
    assert workload_cache.key({"task": "mmlu", "shots": 5}, [data], tiny) != base


@pytest.mark.parametrize("damage", ["truncated", "garbage", "payload"])
def test_a_damaged_entry_is_made_again_with_one_line(tiny, cache, tmp_path, capfd, damage):
    first = _run(tiny, tmp_path, "first")
    (entry,) = cache.glob("*.pkl")
    data = entry.read_bytes()
    if damage == "truncated":
        entry.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        entry.write_bytes(os.urandom(len(data)))
    else:       # header intact, one byte of the payload flipped
        entry.write_bytes(data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:])
    capfd.readouterr()
    again = _run(tiny, tmp_path, "again")
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "cached workload" in err[0] and "preparing it again" in err[0], err
    assert json.loads((again / "summary.json").read_text())["workload"] != "cache"
    _same(first, again)
    assert workload_cache.load(entry) is not None        # made again, whole


def test_dry_run_of_a_cached_workload(tiny, cache, tmp_path):
    o = dict(shots=2, limit=2, subjects=["anatomy", "virology"], model=str(tiny), device="cpu", quiet=True,
             dry_run=True)
    first = run(RunOptions.of(task="mmlu", **o))
    second = run(RunOptions.of(task="mmlu", **o))
    assert isinstance(first, dict) and isinstance(second, dict)
    assert {k: v for k, v in first.items() if k != "time_s"} == {k: v for k, v in second.items() if k != "time_s"}
    assert len(_entries(cache)) == 1


BLOCK = '''import os, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("transformers", "xgrammar", "flashinfer"):
            with open(os.environ["LMBATCH_TEST_IMPORTS"], "a") as f:
                f.write(f"{os.getpid()} {name}\\n")
        return None
sys.meta_path.insert(0, Block())
'''


def test_a_native_run_imports_no_transformers_xgrammar_or_flashinfer(tmp_path):
    """`lmbatch run mmlu` on the embedded model with empty caches (it converts the model, builds its
    tokenizer, prepares the workload in a child process) and again (every cache warm): a hook in every
    process of the run (sitecustomize, inherited by forked and spawned ones) records any import of them."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(BLOCK)
    log = tmp_path / "imports.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]),
           "LMBATCH_CACHE": str(tmp_path / "cache"), "LMBATCH_TEST_IMPORTS": str(log)}
    for run_id in ("first", "repeat"):
        r = subprocess.run([sys.executable, "-c", "from lmbatch.cli import main; main()", "run", "mmlu", "--shots",
                            "1", "--limit", "1", "--subjects", "anatomy", "--out", str(tmp_path), "--run-id", run_id,
                            "--quiet"], env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        summary = json.loads((tmp_path / run_id / "summary.json").read_text())
        assert summary["workload"] == ("child" if run_id == "first" else "cache")
        assert not log.exists(), log.read_text()
    assert (tmp_path / "cache" / "models").is_dir(), "the first run converted the embedded model into the cache"
    # the hook sees imports: the same command with a chat template needs transformers (and logs it)
    subprocess.run([sys.executable, "-c", "from lmbatch.cli import main; main()", "run", "mmlu", "--limit", "1",
                    "--subjects", "anatomy", "--apply-chat-template", "--out", str(tmp_path), "--run-id", "chat",
                    "--quiet"], env=env, capture_output=True, text=True, timeout=600)
    assert "transformers" in log.read_text()
