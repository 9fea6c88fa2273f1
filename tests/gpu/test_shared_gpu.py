"""Data-parallel workers on one GPU (`--data-parallel 2` where one GPU is visible, and auto's choice for tree
of thought on a small model: up to 4): each fits its pool to its share of the free memory, runs its programs
whole, and the run gives one engine's generated text and answers (float32, greedy where the program is)."""
import pytest
from conftest import make_tiny_with_tokenizer, tot_on_workers

from lmbatch.engine.devices import CORES_A_WORKER, GENERATING_SHARE, SHARED_WORKERS, visible_gpus
from lmbatch.engine.threads import usable_cores

pytestmark = pytest.mark.gpu


def test_two_workers_share_one_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    got = tot_on_workers(tmp_path, make_tiny_with_tokenizer(tmp_path / "tiny", 16384), ("1", "2", "auto"))
    (one, s1), (two, s2), (auto, sa) = got["1"], got["2"], got["auto"]
    dp = s2["data_parallel"]
    assert dp["workers"] == 2 and dp["why"] == "asked for: 2 workers on 1 GPU, 2 a GPU"
    assert [w["chunks"] for w in dp["workers_load"]] == [1, 1]
    assert s2["kv_cache_tokens"] <= s1["kv_cache_tokens"]
    assert [(r["id"], r["prediction"], r["outputs"]) for r in two] == [(r["id"], r["prediction"], r["outputs"])
                                                                       for r in one]
    # auto's rule: as many as the cores allow (of GENERATING_SHARE), the GPU's memory known (NVML)
    k = min(GENERATING_SHARE, SHARED_WORKERS, usable_cores() // CORES_A_WORKER) if visible_gpus().memory else 1
    k = k if k >= 2 else 1
    assert sa["data_parallel"]["workers"] == k
    assert sa["data_parallel"]["why"].endswith(f"{k} workers: 1 GPU visible, {k} a GPU: 7 stages" if k > 1
                                               else "1 worker: 1 GPU visible")
    assert [(r["id"], r["prediction"], r["outputs"]) for r in auto] == [(r["id"], r["prediction"], r["outputs"])
                                                                        for r in one]
