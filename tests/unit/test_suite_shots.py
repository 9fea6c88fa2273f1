"""summary.json's `shots` of a suite (issue 47, item 8a): the tasks' shots where every task ran with the
same, None where they differ; one task's as before."""
from __future__ import annotations

import pytest

from lmbatch.options import RunOptions
from lmbatch.programs.registry import get_workload
from lmbatch.run.summary import _shots


@pytest.mark.parametrize("task,shots,want", [
    ("arc_easy:rc,winogrande:mc,mmlu", 5, 5),       # OLMES's fixed 5 and --shots 5 for MMLU: all 5-shot
    ("arc_easy:rc,winogrande:mc,mmlu", 1, None),    # MMLU 1-shot beside OLMES's 5
    ("arc_easy:rc,winogrande:mc", 0, 5),            # OLMES alone: its 5, whatever --shots says
    ("mmlu,hellaswag", 3, 3),
    ("mmlu", 2, 2),
    ("olmes", 5, 5),
])
def test_a_suites_shots_are_its_tasks_where_they_agree(task, shots, want):
    assert _shots(RunOptions.of(task=task, shots=shots), get_workload(task)) == want
