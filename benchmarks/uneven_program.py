"""A program file for `lmbatch run`: three calls of uneven length a program, the case where a wave's barrier
costs most (every program waits for the wave's longest generation). With random weights a generation runs to
its max_tokens, so each instance's lengths are set here: 16 to 256 new tokens, by instance.

    lmbatch run benchmarks/uneven_program.py --model DIR                      # an open stream (the default)
    LMBATCH_BARRIERS=1 lmbatch run benchmarks/uneven_program.py --model DIR   # waves
"""
from lmbatch.frontend import gen, select

N = 2000
PREFIX = "You answer questions about numbers, one short step at a time.\n\n"


def instances():
    return [{"id": f"u{k}", "k": k} for k in range(N)]


def program(s, k):
    s += PREFIX + f"Question {k}: what can you say about the number {k * 7919 % 10007}?\n"
    s += gen("first", max_tokens=16 + (k * 37) % 241, temperature=0.8)
    s += "\nIs that right?" + select("check", [" yes", " no"])
    s += "\nSay more:" + gen("second", max_tokens=16 + (k * 53) % 241, temperature=0.8)
