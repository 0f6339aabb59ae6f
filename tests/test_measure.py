from __future__ import annotations

import mmap
import os
import subprocess
import sys
import threading
import time

import psutil
import pytest

from loader_search.trial._measure import PeakRSS, StepMeter, WindowStats, tree_rss_bytes


def test_window_excludes_warmup_batches() -> None:
    meter = StepMeter(warmup_batches=2)
    meter.start()
    for step in range(6):
        meter.wait_begin()
        time.sleep(0.3 if step == 0 else 0.01)  # a slow first batch: worker start-up
        meter.wait_end()
        meter.step(10)
        assert meter.in_window == (step >= 1)
    stats = meter.finish()
    assert stats.measured_samples == 40  # batches 3..6
    assert stats.time_to_first_batch_s >= 0.3
    assert stats.measured_time_s < 0.25  # the 0.3 s start is not in the window
    assert 0.0 < stats.data_wait_fraction <= 1.0
    assert stats.throughput == pytest.approx(40 / stats.measured_time_s)


def _window_touching(mib: int) -> WindowStats:
    """A 2-batch window whose second batch touches ``mib`` MiB of fresh pages once each."""
    meter = StepMeter(warmup_batches=1)
    meter.start()
    for step in range(3):
        meter.wait_begin()
        meter.wait_end()
        if step == 2 and mib:
            block = mmap.mmap(-1, mib * 2**20)
            for offset in range(0, len(block), mmap.PAGESIZE):
                block[offset] = 1
            block.close()
        meter.step(4)
    return meter.finish()


def test_the_window_counts_the_page_faults_of_memory_touched_inside_it() -> None:
    pages = 64 * 2**20 // mmap.PAGESIZE
    touched = _window_touching(64).minor_faults
    assert touched is not None and touched >= pages * 0.9
    # A window that touches nothing new faults far less.
    assert (_window_touching(0).minor_faults or 0) < pages / 10


def test_finish_without_measured_batches_is_an_error() -> None:
    meter = StepMeter(warmup_batches=3)
    meter.start()
    for _ in range(3):
        meter.wait_begin()
        meter.wait_end()
        meter.step(4)
    with pytest.raises(ValueError, match="raise the training budget"):
        meter.finish()


def test_peak_rss_includes_child_processes() -> None:
    with PeakRSS(interval_s=0.02) as alone:
        time.sleep(0.1)
    code = "b = bytearray(300 * 2**20); import time; time.sleep(1.0)"
    with PeakRSS(interval_s=0.02) as with_child:
        child = subprocess.Popen([sys.executable, "-c", code])
        child.wait(timeout=30)
    assert with_child.peak_bytes - alone.peak_bytes > 250 * 2**20


def test_peak_rss_without_children_runs_no_thread_and_sees_a_spike_between_samples() -> None:
    # The kernel's high-water mark, reset at the start: a spike that ends long before any
    # sample would come (interval 1 h) is counted, and no thread wakes beside the training.
    with PeakRSS(interval_s=3600, children=False) as alone:
        pass
    with PeakRSS(interval_s=3600, children=False) as spike:
        assert not any(t.name == "peak-rss" for t in threading.enumerate())
        block = b"\x01" * (300 * 2**20)  # written: resident
        del block
    assert spike.peak_bytes - alone.peak_bytes > 250 * 2**20
    # Each block's own peak, not the process's since it started.
    with PeakRSS(interval_s=3600, children=False) as after:
        pass
    assert after.peak_bytes < spike.peak_bytes - 250 * 2**20


def test_the_tree_reading_from_proc_agrees_with_psutil() -> None:
    code = "b = bytearray(200 * 2**20); import time; time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 20
        me = psutil.Process()
        while time.monotonic() < deadline:  # until the child holds its 200 MiB
            if psutil.Process(child.pid).memory_info().rss > 200 * 2**20:
                break
            time.sleep(0.05)
        from_proc = tree_rss_bytes(os.getpid())
        by_psutil = me.memory_info().rss + sum(c.memory_info().rss for c in me.children(True))
    finally:
        child.kill()
        child.wait(timeout=30)
    assert from_proc is not None, "this Linux has /proc/PID/task/TID/children"
    assert from_proc > 200 * 2**20
    assert abs(from_proc - by_psutil) < 0.05 * by_psutil
    assert tree_rss_bytes(2**22 + 12345) is None  # no such process
