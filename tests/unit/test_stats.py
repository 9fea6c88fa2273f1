"""lmbatch.results.stats: standard errors and the paired tests, against hand computations and lm-eval."""
import math
import random

import pytest

from lmbatch.results.stats import MCNEMAR, PAIRED_T, mcnemar_midp, mean_stderr, paired_t, paired_test


def test_mean_stderr_by_hand():
    # mean 0.75; squared deviations 3 * 0.0625 + 0.5625 = 0.75; / (n - 1) = 0.25; sqrt 0.5; / sqrt(4) = 0.25
    assert mean_stderr([1.0, 0.0, 1.0, 1.0]) == pytest.approx(0.25, abs=1e-15)
    # 0.2, 0.4, 0.9: mean 0.5, deviations 0.09 + 0.01 + 0.16 = 0.26, / 2 = 0.13, sqrt / sqrt(3)
    assert mean_stderr([0.2, 0.4, 0.9]) == pytest.approx(math.sqrt(0.13) / math.sqrt(3), rel=1e-14)
    assert mean_stderr([1.0, 1.0, 1.0]) == 0.0
    assert mean_stderr([0.5]) is None and mean_stderr([]) is None        # lm-eval's "N/A"


def test_mean_stderr_is_lm_evals():
    metrics = pytest.importorskip("lm_eval.api.metrics")
    rng = random.Random(0)
    for values in ([rng.random() for _ in range(57)], [float(rng.random() < 0.3) for _ in range(1000)]):
        assert mean_stderr(values) == pytest.approx(metrics.mean_stderr(values), rel=1e-12)


def test_mcnemar_midp_by_hand():
    # 0 of 5 discordant pairs went the other way: P(X <= 0) = 1/32, P(X = 0) = 1/32, mid-p 2/32 - 1/32
    assert mcnemar_midp(0, 5) == mcnemar_midp(5, 0) == 1 / 32
    # 3 vs 10: P(X <= 3) = (1 + 13 + 78 + 286) / 2^13, P(X = 3) = 286 / 2^13
    assert mcnemar_midp(3, 10) == (2 * 378 - 286) / 8192
    assert mcnemar_midp(7, 7) == 1.0 and mcnemar_midp(0, 0) == 1.0
    # below the exact test's p (2 P(X <= k)), by P(X = k)
    assert mcnemar_midp(3, 10) < 2 * 378 / 8192
    # large counts in exact integers: no overflow, no underflow to a wrong 0
    assert 0 < mcnemar_midp(6800, 7200) < 1e-3 and mcnemar_midp(7000, 7000) == 1.0
    with pytest.raises(ValueError):
        mcnemar_midp(-1, 3)


def test_mcnemar_midp_keeps_its_level():
    """Under no difference, P(p < 0.05) stays near 0.05 (exactly computed over Binomial(n, 1/2))."""
    for n in (20, 60, 200):
        size = sum(math.comb(n, b) for b in range(n + 1) if mcnemar_midp(b, n - b) < 0.05) / 2 ** n
        assert 0.02 < size <= 0.06, (n, size)


def test_paired_test_picks_mcnemar_for_right_or_wrong():
    base = [1.0] * 30 + [0.0] * 30
    cand = [0.0] * 12 + [1.0] * 18 + [1.0] * 2 + [0.0] * 28     # 12 went wrong, 2 went right
    p = paired_test(base, cand)
    assert (p.test, p.n, p.worse, p.better) == (MCNEMAR, 60, 12, 2)
    assert p.p == mcnemar_midp(12, 2) and p.delta == pytest.approx(-10 / 60)
    assert p.delta_stderr == pytest.approx(mean_stderr([c - b for b, c in zip(base, cand)]))


def test_paired_test_of_scores_that_are_not_zero_or_one():
    """A continuous metric (an f1) gets the paired t-test: Student's t with n - 1 degrees of freedom, as
    scipy.stats.ttest_rel computes it (t = -2.6112, 3 df)."""
    base, cand = [0.2, 0.4, 0.9, 0.5], [0.1, 0.4, 0.7, 0.3]
    p = paired_test(base, cand)
    d = [-0.1, 0.0, -0.2, -0.2]
    t = (sum(d) / 4) / mean_stderr(d)
    assert t == pytest.approx(-2.6111648, rel=1e-6)
    # two-sided p of t with 3 df, I_{3/(3+t^2)}(3/2, 1/2): scipy.stats.t.sf(2.6111648, 3) * 2 = 0.0796050
    assert p.test == PAIRED_T and p.p == pytest.approx(0.0796050, rel=1e-5)
    assert paired_t([0.0, 0.0]) == 1.0 and paired_t([0.1, 0.1]) == 0.0 and paired_t([0.5]) == 1.0


@pytest.mark.parametrize("seed", range(5))
def test_paired_t_matches_scipy(seed):
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(seed)
    n = rng.choice([3, 10, 57, 400])
    base = [rng.random() for _ in range(n)]
    cand = [b - 0.05 + rng.gauss(0, 0.2) for b in base]
    want = stats.ttest_rel(cand, base).pvalue
    assert paired_test(base, cand).p == pytest.approx(want, rel=1e-9, abs=1e-300)
    with pytest.raises(ValueError):
        paired_test([1.0], [1.0, 0.0])


def test_holm_by_hand():
    from lmbatch.results.stats import holm

    # sorted 0.01, 0.03, 0.04 times 3, 2, 1: 0.03, 0.06, 0.04 -> kept non-decreasing: 0.03, 0.06, 0.06
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.2]) == [0.2] and holm([]) == [] and holm([0.5, 0.9]) == [1.0, 1.0]
