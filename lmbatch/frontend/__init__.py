"""The frontend: what turns LM programs into engine requests.

`dsl` is the language programs are written in (`from lmbatch.frontend import gen, select`);
`tokenize` gives token ids (with lm-eval's context/continuation split for selects); `calls` prepares
each queued call (ids, length checks, grammar) and turns calls into engine requests and results back;
`runs` is one program in its greenlet; `waves` picks which calls run together; `tally` counts them;
`interpreter` runs the programs wave by wave; `workload` and `registry` describe and find the
workloads. Importing this package loads only the DSL.
"""
from lmbatch.frontend.dsl import Gen, Pending, Select, State, gen, select

__all__ = ["Gen", "Pending", "Select", "State", "gen", "select"]
