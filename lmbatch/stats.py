"""Standard errors and paired significance tests over per-instance scores: pure functions of numbers.

`mean_stderr` is lm-eval's standard error of a mean (`lm_eval.api.metrics.mean_stderr`); `paired_test`
tells whether two runs over the same instances differ by more than noise (McNemar's mid-p test when every
score is 0 or 1, as acc is; a paired z-test on the differences otherwise); `holm` adjusts the p values of
several such tests (a suite's tasks) made together."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

MCNEMAR, PAIRED_Z = "McNemar mid-p", "paired z"


def mean(values: Sequence[float]) -> float | None:
    """The arithmetic mean; None for no values."""
    return math.fsum(values) / len(values) if values else None


def mean_stderr(values: Sequence[float]) -> float | None:
    """The standard error of the mean of `values`, lm-eval's formula: sqrt(sum((x - mean)^2) / (n - 1)) / sqrt(n)
    (the sample standard deviation, ddof=1, over sqrt(n)). None for fewer than two values (lm-eval's "N/A")."""
    n = len(values)
    if n < 2:
        return None
    mu = math.fsum(values) / n
    return math.sqrt(math.fsum((x - mu) ** 2 for x in values) / (n - 1)) / math.sqrt(n)


def binomial_half_tail(n: int, k: int) -> tuple[int, int]:
    """(sum of C(n, i) for i <= k, C(n, k)) as exact integers: P(X <= k) and P(X = k) times 2^n for
    X ~ Binomial(n, 1/2)."""
    term, cumulative = 1, 1          # C(n, 0)
    for i in range(k):
        term = term * (n - i) // (i + 1)
        cumulative += term
    return cumulative, term


def mcnemar_midp(b: int, c: int) -> float:
    """Two-sided McNemar mid-p value of b pairs that went 1 -> 0 against c that went 0 -> 1.

    Under no difference each of the n = b + c discordant pairs goes either way with probability 1/2, so
    min(b, c) is Binomial(n, 1/2)'s lower tail: exact p = 2 P(X <= k), and the mid-p value counts the
    observed outcome half, 2 P(X <= k) - P(X = k). The mid-p test keeps close to its nominal level where the
    exact one is conservative and the chi-squared approximation is not valid for few discordant pairs
    (Fagerland, Lydersen and Laake, BMC Med Res Methodol 13:91, 2013). Computed exactly in integers."""
    if b < 0 or c < 0:
        raise ValueError(f"counts must be at least 0, not {b} and {c}")
    n, k = b + c, min(b, c)
    if n == 0:
        return 1.0
    cumulative, at_k = binomial_half_tail(n, k)
    return min(1.0, (2 * cumulative - at_k) / 2 ** n)


def paired_z(differences: Sequence[float]) -> float:
    """Two-sided p value that the mean of paired differences is 0 (normal approximation: the mean over
    its standard error, `mean_stderr`). No variation: 1.0 when every difference is 0, else 0.0."""
    mu, se = mean(differences), mean_stderr(differences)
    if mu is None or se is None or se == 0:
        return 1.0 if not mu else 0.0
    return math.erfc(abs(mu / se) / math.sqrt(2))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of p values tested together: the i-th smallest of m becomes
    max over j <= i of min(1, (m - j) p_(j)). Rejecting where the adjusted p is below alpha keeps the chance
    of any false rejection among them at most alpha, whatever their dependence (Holm, Scand J Stat 6:65, 1979)."""
    m = len(pvalues)
    out, running = [1.0] * m, 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda i: pvalues[i])):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


@dataclass(frozen=True)
class Paired:
    """A paired comparison of the same instances' scores in two runs."""
    n: int                  # instances scored in both
    base: float | None      # the means over those
    cand: float | None
    p: float                # two-sided p value of no difference
    test: str               # MCNEMAR or PAIRED_Z
    worse: int              # instances whose score dropped (McNemar's b)
    better: int             # instances whose score rose (McNemar's c)
    delta_stderr: float | None = None   # the standard error of the mean difference (`mean_stderr`)

    @property
    def delta(self) -> float:
        """cand - base over the paired instances (0 when there are none)."""
        return 0.0 if self.base is None or self.cand is None else self.cand - self.base


def paired_test(base: Sequence[float], cand: Sequence[float]) -> Paired:
    """Compare per-instance scores of the same instances (base[i] and cand[i] are one instance's):
    McNemar's mid-p test when every score is 0 or 1, a paired z-test on the differences otherwise."""
    if len(base) != len(cand):
        raise ValueError(f"paired scores of {len(base)} and {len(cand)} instances")
    worse = sum(b > c for b, c in zip(base, cand))
    better = sum(c > b for b, c in zip(base, cand))
    differences = [c - b for b, c in zip(base, cand)]
    if all(v in (0.0, 1.0) for v in (*base, *cand)):
        p, test = mcnemar_midp(worse, better), MCNEMAR
    else:
        p, test = paired_z(differences), PAIRED_Z
    return Paired(len(base), mean(base), mean(cand), p, test, worse, better, mean_stderr(differences))
