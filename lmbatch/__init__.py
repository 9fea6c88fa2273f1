"""lmbatch: offline batch evaluation of LM programs, executed in DFS order over a radix tree."""

__version__ = "0.1.0"
