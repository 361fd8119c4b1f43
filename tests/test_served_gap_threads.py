"""client/tools/benchmarks/served_gap.py's CPU seconds per thread: finer than a clock tick, so that a
short figure's work (a tiny model's TTFT, a few milliseconds) is seen and its CPU ratio computed."""
import os
import time

from client.tools.benchmarks.served_gap import Threads


def test_a_few_milliseconds_of_work_are_seen_in_a_thread_not_rounded_to_ticks():
    threads = Threads([os.getpid()])
    before = threads.snap()
    start = time.thread_time()
    while time.thread_time() - start < 0.003:  # 3 ms of this thread's CPU, however loaded the machine
        pass
    after = threads.snap()
    # clock ticks (psutil's thread times) read 0, 0.01 or 0.02 s here
    assert any(0.003 <= after[tid] - before.get(tid, 0.0) < 0.009 for tid in after), (before, after)
    assert any(0.003 <= used < 0.009 for used, _ in Threads.busy(before, after, wall=0.05))


def test_memory_touched_for_the_first_time_is_counted_in_minor_faults():
    import mmap

    threads = Threads([os.getpid()])
    before = threads.minor_faults()
    pages = 2048
    region = mmap.mmap(-1, pages * mmap.PAGESIZE)  # anonymous, not huge: a fault a page on first touch
    for i in range(pages):
        region[i * mmap.PAGESIZE] = 1
    assert threads.minor_faults() - before >= pages
    region.close()
