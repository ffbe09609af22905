"""The memory-bandwidth ceiling bench/kernels.py holds each row to: a GPU's HBM peak from
its spec sheet, and a copy measured in the same run (the ceiling on a CPU, or on a GPU the
table does not know).

Issue 15's target is 80% of the spec peak for decode at B=64, ctx=4096. No kernel reaches
the spec figure, a plain copy included, so the copy measured beside it says how much of a
kernel's gap is the device's own. On a CPU the copy (256 MiB, past any cache) is the
ceiling, and a row whose working set fits in the last-level cache can exceed it (a
fraction above 1): there it measures cache, not memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

#: Spec-sheet HBM bandwidth, GB/s; the first entry whose fragments all occur in the
#: device name wins, so the more specific names come first.
HBM_PEAK_GBPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H200",), 4800.0),
    (("H100", "PCIe"), 2000.0),
    (("H100", "NVL"), 3900.0),
    (("H100",), 3350.0),  # SXM
    (("A100", "80GB"), 2000.0),  # SXM4 2.04 TB/s, PCIe 1.94
    (("A100",), 1555.0),  # 40 GB
)
#: Bytes the copy moves each way: large enough to leave every cache behind.
COPY_BYTES = {"cuda": 1 << 30, "cpu": 256 << 20}


@dataclass(frozen=True)
class Ceiling:
    peak_gbps: float  # what fraction_of_peak divides by
    source: str  # where peak_gbps comes from
    copy_gbps: float  # a large tensor copy measured in this run, read + write bytes / time


def spec_peak_gbps(device_name: str) -> float | None:
    """The table's HBM peak for a device name, or None if it is not in the table."""
    for fragments, gbps in HBM_PEAK_GBPS:
        if all(f in device_name for f in fragments):
            return gbps
    return None


def copy_gbps(device: str, time_ms: Callable[[Callable[[], object]], float]) -> float:
    """GB/s of `dst.copy_(src)`, counting the read and the write."""
    n = COPY_BYTES[device]
    src = torch.ones(n // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * n / ms / 1e6


def ceiling(device_name: str, cuda: bool, time_ms: Callable[[Callable[[], object]], float]) -> Ceiling:
    """The spec peak where the table knows the GPU, else the measured copy."""
    measured = copy_gbps("cuda" if cuda else "cpu", time_ms)
    peak = spec_peak_gbps(device_name) if cuda else None
    if peak is not None:
        return Ceiling(peak, f"{device_name} HBM spec sheet", measured)
    what = "this GPU is not in bench/bandwidth.HBM_PEAK_GBPS" if cuda else "the CPU's own memory"
    mib = COPY_BYTES["cuda" if cuda else "cpu"] >> 20
    return Ceiling(measured, f"a {mib} MiB tensor copy measured in this run ({what})", measured)
