"""Standard errors and paired significance tests over per-instance scores: pure functions of numbers.

`mean_stderr` is lm-eval's standard error of a mean (`lm_eval.api.metrics.mean_stderr`); `paired_test`
tells whether two runs over the same instances differ by more than noise (McNemar's mid-p test when every
score is 0 or 1, as acc is; a paired t-test on the differences otherwise); `holm` adjusts the p values of
several such tests (a suite's tasks) made together."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

MCNEMAR, PAIRED_T = "McNemar mid-p", "paired t"


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


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes' betacf)."""
    tiny = 1e-300

    def nonzero(v: float) -> float:
        return v if abs(v) > tiny else tiny

    c, d = 1.0, 1.0 / nonzero(1.0 - (a + b) * x / (a + 1.0))
    h = d
    for m in range(1, 1000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 / nonzero(1.0 + numerator * d)
            c = nonzero(1.0 + numerator / c)
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def paired_t(differences: Sequence[float]) -> float:
    """Two-sided p value of the paired t-test that the mean of paired differences is 0: t = mean / its
    standard error (`mean_stderr`), Student's t with n - 1 degrees of freedom, p = I_{df/(df+t^2)}(df/2, 1/2).
    Fewer than two differences: 1.0 (nothing to test). No variation: 1.0 when every difference is 0, else 0.0."""
    mu, se = mean(differences), mean_stderr(differences)
    if mu is None or se is None:
        return 1.0
    if se == 0:
        return 1.0 if not mu else 0.0
    df = len(differences) - 1
    t = mu / se
    return min(1.0, betainc(df / 2.0, 0.5, df / (df + t * t)))


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
    test: str               # MCNEMAR or PAIRED_T
    worse: int              # instances whose score dropped (McNemar's b)
    better: int             # instances whose score rose (McNemar's c)
    delta_stderr: float | None = None   # the standard error of the mean difference (`mean_stderr`)

    @property
    def delta(self) -> float:
        """cand - base over the paired instances (0 when there are none)."""
        return 0.0 if self.base is None or self.cand is None else self.cand - self.base


def paired_test(base: Sequence[float], cand: Sequence[float]) -> Paired:
    """Compare per-instance scores of the same instances (base[i] and cand[i] are one instance's):
    McNemar's mid-p test when every score is 0 or 1 (a binary metric), a paired t-test on the differences
    otherwise (a continuous one)."""
    if len(base) != len(cand):
        raise ValueError(f"paired scores of {len(base)} and {len(cand)} instances")
    worse = sum(b > c for b, c in zip(base, cand))
    better = sum(c > b for b, c in zip(base, cand))
    differences = [c - b for b, c in zip(base, cand)]
    if all(v in (0.0, 1.0) for v in (*base, *cand)):
        p, test = mcnemar_midp(worse, better), MCNEMAR
    else:
        p, test = paired_t(differences), PAIRED_T
    return Paired(len(base), mean(base), mean(cand), p, test, worse, better, mean_stderr(differences))
