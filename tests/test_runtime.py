"""runtime.Stopwatch: the time of the regions it wraps, summed, read once they are done."""

from __future__ import annotations

import time

import torch

from dflash_hf.runtime import Stopwatch


def test_stopwatch_sums_its_regions_and_reads_them_once():
    watch = Stopwatch(torch.device("cpu"))
    for _ in range(2):
        with watch:
            time.sleep(0.01)
    time.sleep(0.2)  # outside every region
    total = watch.total
    assert 0.02 <= total < 0.15
    assert watch.total == total  # read again: the same regions, counted once
    with watch:
        pass
    assert watch.total >= total
