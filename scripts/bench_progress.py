"""Timestamped progress lines on stderr for the benchmark scripts scripts/device_check.py runs.

The benchmarks print their figures as one JSON line on stdout at the end, which a part killed
at its time limit never prints (and device_check loses a killed part's stdout). On the first
accelerator run four parts timed out with nothing in their logs but the command line; these
lines, written as each phase ends and flushed at once, go to the part's log (device_check
sends stderr there), so a timed-out part's log says where it was:

    [18:02:11 +41.3s bench_real_size] learner: train step compiled in 12.4 s
"""
from __future__ import annotations

import os
import sys
import time


def _process_start() -> float:
    """`time.monotonic()` at this process's start (Linux: /proc), else at this import."""
    now = time.monotonic()
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start since boot
        return now - max(uptime - started, 0.0)
    except (OSError, ValueError, IndexError):
        return now


_T0 = _process_start()


def progress(message: str) -> None:
    """One line on stderr: wall-clock time, seconds since the process started, the script."""
    script = os.path.splitext(os.path.basename(sys.argv[0] or "python"))[0]
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - _T0:.1f}s {script}] {message}",
          file=sys.stderr, flush=True)
