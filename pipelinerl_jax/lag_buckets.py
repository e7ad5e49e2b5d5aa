"""The lag buckets every staleness report uses: 0, 1, 2, 3-4, 5-8, 9+.

A token trained `lag` versions after it was sampled falls in the last bucket whose lower
edge is <= lag (negative lags count as 0). The train step's diagnostics
(`losses/diagnostics.py`), the lag controller and the results tables all index by these names,
so they are defined here once, in a module with no JAX in it (the launcher and the results
scripts import it without starting a backend).
"""
from __future__ import annotations

LAG_BUCKETS = ("0", "1", "2", "3-4", "5-8", "9+")
LOWER_EDGES = (0, 1, 2, 3, 5, 9)  # bucket i holds lags in [LOWER_EDGES[i], LOWER_EDGES[i+1])

