"""Importing omnidraft puts torch's large allocations (the models' weights) in transparent huge pages.

A one-row decoding step streams every weight once; with 4 KiB pages the TLB misses cost the fp32
target a quarter of its step on the hosts measured (docs/performance.md, "Huge pages"). Checked in a
fresh interpreter: PyTorch reads THP_MEM_ALLOC_ENABLE once, at its first allocation.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
TENSOR_KIB = 64 * 1024  # a 64 MiB tensor, well above PyTorch's 2 MiB threshold for huge pages
PROBE = ("import omnidraft, torch, re\n"
         "t = torch.empty(64 * 2**20 // 4).fill_(1.0)\n"
         "print(re.search(r'AnonHugePages:\\s+(\\d+)', open('/proc/self/smaps_rollup').read()).group(1))\n")


def thp_mode() -> str | None:
    """The kernel's THP mode ("always", "madvise", "never"), None where there is none to read."""
    try:
        return re.search(r"\[(\w+)\]", THP_MODE.read_text()).group(1)
    except (OSError, AttributeError):
        return None


def huge_kib(**env: str) -> int:
    """KiB of anonymous huge pages in a fresh interpreter that imports omnidraft and fills a 64 MiB tensor."""
    clean = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         check=True, timeout=120)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(sys.platform != "linux" or thp_mode() not in ("madvise", "always"),
                    reason="transparent huge pages exist on Linux only, and this kernel has them off")
def test_importing_omnidraft_puts_large_tensors_in_huge_pages_and_the_users_setting_wins():
    assert huge_kib() >= TENSOR_KIB // 2  # most of the tensor: its ends may fall outside whole 2 MiB pages
    if thp_mode() == "madvise":  # with "always" the kernel uses huge pages whatever torch asks
        assert huge_kib(THP_MEM_ALLOC_ENABLE="0") < TENSOR_KIB // 2
