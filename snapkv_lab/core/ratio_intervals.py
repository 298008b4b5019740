"""t intervals, t tests and TOST equivalence tests of a pooled ratio over a handful of units (prompts, documents).

A findings value pools a ratio over prompts, R = sum_i numerator_i / sum_i support_i, and rests on 4 to 12 prompts.
A percentile bootstrap over so few units undercovers: at 4 to 8 units its nominal 95% interval holds the true value
73-89% of the time, and BCa (scipy.stats.bootstrap(method="BCa")) no better (tests/test_ratio_intervals.py simulates
it). The t interval over per-unit values is exact for normal per-unit values and loses least under skew, so the
findings use it:

- the ratio is linearised (the delta method, Cochran 1977, "Sampling Techniques", 6.3): unit i's residual is
  z_i = (numerator_i - R * support_i) / mean(support), the standard error is sd(z) / sqrt(n) and the interval is
  R +- t_{n-1} * se. Where every unit has the same support (recall: one unit per generated row), z_i is the unit's
  own value minus the mean, and this is exactly the t interval of the per-unit values;
- a paired difference R_a - R_b over the same units takes z_i = z_a,i - z_b,i: the t interval of per-unit differences;
- `t_test` is the two-sided one-sample t test of that difference against 0, and `tost` the two one-sided tests
  (Schuirmann 1987) of |difference| < margin: equivalence at level alpha is shown where the (1 - 2 alpha) interval
  lies inside (-margin, margin).

Arrays are (groups, units), NaN where a group lacks a unit; every result is per group.
"""

from __future__ import annotations

import warnings

import numpy as np
from scipy import stats


def _validate_ci(ci: float) -> None:
    if not 0 < ci < 1:
        raise ValueError(f"ci must lie in (0, 1), got {ci}")


def linearised(numerator: np.ndarray, support: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(groups, units) numerators and supports (NaN: unit absent) -> the pooled ratio (groups,) and each unit's
    linearised residual (groups, units), NaN where absent. A group with no support has NaN ratio and residuals."""
    numerator, support = np.asarray(numerator, float), np.asarray(support, float)
    if numerator.shape != support.shape or numerator.ndim != 2:
        raise ValueError(f"numerator and support must be (groups, units) alike, got {numerator.shape} and "
                         f"{support.shape}")
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.nansum(numerator, 1) / np.nansum(support, 1)
        residual = (numerator - ratio[:, None] * support) / np.nanmean(support, 1)[:, None]
    return ratio, residual


def standard_error(residual: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(groups, units) residuals -> (standard error, units present) per group; NaN where fewer than 2 units."""
    n = np.sum(~np.isnan(residual), 1)
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # groups of fewer than 2 units: NaN, said by n
        se = np.nanstd(residual, 1, ddof=1) / np.sqrt(n)
    return np.where(n >= 2, se, np.nan), n


def t_interval(estimate: np.ndarray, se: np.ndarray, n: np.ndarray, ci: float) -> tuple[np.ndarray, np.ndarray]:
    """estimate +- t_{n-1, (1 + ci) / 2} * se per group (NaN where n < 2)."""
    _validate_ci(ci)
    half = stats.t.ppf((1 + ci) / 2, np.maximum(n - 1, 1)) * se
    half = np.where(n >= 2, half, np.nan)
    return estimate - half, estimate + half


def mean_t_interval(values: np.ndarray, ci: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high) of one group of per-unit `values` (units,): its mean and t interval, NaN where fewer than
    2 units (the mean NaN with none)."""
    values = np.asarray(values, float)
    n = len(values)
    mean = values.mean() if n else np.nan
    se = values.std(ddof=1) / np.sqrt(n) if n > 1 else np.nan
    low, high = t_interval(np.array([mean]), np.array([se]), np.array([n]), ci)
    return float(mean), float(low[0]), float(high[0])


def interval_text(estimate: float, low: float, high: float) -> str:
    """An estimate and its interval as the docs' tables print them, whole numbers: "75 [36, 114]", the estimate alone
    where the interval is NaN (fewer than 2 units)."""
    return f"{estimate:.0f}" + ("" if np.isnan(low) else f" [{low:.0f}, {high:.0f}]")


def _t_statistic(shift: np.ndarray, se: np.ndarray) -> np.ndarray:
    """shift / se, with 0 / 0 = 0 (identical units, no shift) and x / 0 = +-inf."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where((se == 0) & (shift == 0), 0.0, shift / se)


def t_test(estimate: np.ndarray, se: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Two-sided p of the t test of estimate = 0 (df n - 1) per group; NaN where n < 2."""
    p = 2 * stats.t.sf(np.abs(_t_statistic(np.asarray(estimate, float), se)), np.maximum(n - 1, 1))
    return np.where(n >= 2, p, np.nan)


def tost(estimate: np.ndarray, se: np.ndarray, n: np.ndarray, margin: float) -> np.ndarray:
    """p of the two one-sided t tests of -margin < true value < margin (the larger of the two p values) per group;
    p < alpha shows equivalence at level alpha. NaN where n < 2."""
    if not margin > 0:
        raise ValueError(f"an equivalence margin must be positive, got {margin}")
    estimate = np.asarray(estimate, float)
    df = np.maximum(n - 1, 1)
    above_lower = stats.t.sf(_t_statistic(estimate + margin, se), df)  # H0: value <= -margin
    below_upper = stats.t.cdf(_t_statistic(estimate - margin, se), df)  # H0: value >= +margin
    return np.where(n >= 2, np.maximum(above_lower, below_upper), np.nan)
