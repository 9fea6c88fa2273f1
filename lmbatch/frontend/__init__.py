"""The frontend: what turns LM programs into engine requests.

`dsl` is the language programs are written in (`from lmbatch.frontend import gen, select`);
`tokenize` prepares each call's token ids (with lm-eval's context/continuation split for selects);
`interpreter` runs the programs and sends their calls to the engine in waves; `workload` and
`registry` describe and find the workloads. Importing this package loads only the DSL.
"""
from lmbatch.frontend.dsl import Gen, Pending, Select, State, gen, select

__all__ = ["Gen", "Pending", "Select", "State", "gen", "select"]
