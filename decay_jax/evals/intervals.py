"""Means, standard deviations and 95% intervals over seeds, and which differences they separate.

For ``n`` runs ``x_1..x_n`` of one arm: mean ``m``, sample standard deviation ``s`` (``n - 1`` in
the denominator) and the Student-t interval ``m +- t_{0.975, n-1} s / sqrt(n)``.

Two arms ``a``, ``b`` are compared by Welch's interval for the difference of their means:
``(m_a - m_b) +- t_{0.975, nu} sqrt(s_a^2/n_a + s_b^2/n_b)`` with the Welch-Satterthwaite degrees of
freedom ``nu = (v_a + v_b)^2 / (v_a^2/(n_a-1) + v_b^2/(n_b-1))``, ``v = s^2/n``. The difference is
*separated* when that interval excludes 0. (Two overlapping per-arm intervals can still separate
the difference, so the verdict reads the difference's interval, not the arms'.) One run per arm
gives no interval and no verdict. Seeds vary the initialisation, the data order and the
augmentation together.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

import numpy as np
from scipy import stats


def summary(values: Sequence[float]) -> Dict[str, Optional[float]]:
  """``{'n', 'mean', 'sd', 'lo', 'hi'}`` of ``values`` (``sd``, ``lo``, ``hi`` None for one value)."""
  x = np.asarray(values, np.float64)
  n = int(x.size)
  if n == 0:
    raise ValueError("summary of no values")
  mean = float(x.mean())
  if n == 1:
    return {"n": 1, "mean": mean, "sd": None, "lo": None, "hi": None}
  sd = float(x.std(ddof=1))
  half = float(stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
  return {"n": n, "mean": mean, "sd": sd, "lo": mean - half, "hi": mean + half}


def difference(a: Sequence[float], b: Sequence[float]) -> Dict[str, Optional[float]]:
  """``{'diff', 'lo', 'hi', 'separated'}``: Welch's 95% interval of ``mean(a) - mean(b)``.

  ``lo``, ``hi`` and ``separated`` are None when either side has one value. Equal constant sides
  (both standard deviations 0) give the exact difference as the interval.
  """
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  diff = float(a.mean() - b.mean())
  if a.size < 2 or b.size < 2:
    return {"diff": diff, "lo": None, "hi": None, "separated": None}
  va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
  if va + vb == 0.0:
    return {"diff": diff, "lo": diff, "hi": diff, "separated": diff != 0.0}
  nu = (va + vb) ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1))
  half = float(stats.t.ppf(0.975, nu)) * math.sqrt(va + vb)
  lo, hi = diff - half, diff + half
  return {"diff": diff, "lo": lo, "hi": hi, "separated": bool(lo > 0.0 or hi < 0.0)}
