"""What the ncu scripts share (step_kernels.sh, forward_ncu.sh): one profiled call of a
warm jitted program, and ncu's CSV (`--csv --print-units base --print-metric-name name`)
read back as one entry per kernel."""

from __future__ import annotations

import collections
import csv
import ctypes
import glob
import os
import site
from collections.abc import Callable
from typing import Any, NamedTuple


def profile_one_call(call: Callable[[], Any]) -> None:
    """call() twice to compile and warm it, then once between cudaProfilerStart and Stop
    (ncu --profile-from-start off profiles only that one)."""
    import jax

    jax.block_until_ready(call())
    jax.block_until_ready(call())
    libs = [p for d in site.getsitepackages() + ["/usr/local/cuda/lib64"]
            for p in glob.glob(os.path.join(d, "**", "libcudart.so*"), recursive=True)]
    runtime = ctypes.CDLL(sorted(libs)[0])
    runtime.cudaProfilerStart()
    jax.block_until_ready(call())
    runtime.cudaProfilerStop()


class Kernel(NamedTuple):
    name: str
    block: str
    grid: str
    metrics: dict[str, float]  # metric name -> value; those ncu could not read left out

    @property
    def us(self) -> float:
        return self.metrics.get("gpu__time_duration.sum", float("nan")) / 1e3

    def stalls(self, count: int = 5) -> list[tuple[float, str]]:
        """The largest stall reasons, warps stalled per issued instruction, largest first."""
        return sorted(((v, k) for k, v in self.metrics.items()
                       if "issue_stalled" in k and "not_issued" not in k), reverse=True)[:count]

    def counts(self) -> dict[str, float]:
        """The metrics besides the time and the stall reasons."""
        return {k: v for k, v in self.metrics.items()
                if k != "gpu__time_duration.sum" and "issue_stalled" not in k}


def read_kernels(path: str) -> list[Kernel]:
    """The kernels of ncu's CSV in launch order."""
    rows: dict[str, tuple[str, str, str]] = {}
    metrics: dict[str, dict[str, float]] = collections.defaultdict(dict)
    with open(path) as f:
        for r in csv.reader(f):
            if len(r) >= 15 and r[0].isdigit():  # ID, ..., Kernel Name (4), Block (7), Grid (8)
                rows[r[0]] = (r[4], r[7], r[8])
                try:
                    metrics[r[0]][r[12]] = float(r[14].replace(",", ""))
                except ValueError:  # a metric ncu could not read ("n/a")
                    pass
    return [Kernel(*rows[i], metrics[i]) for i in rows if metrics[i]]
