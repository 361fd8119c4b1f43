"""backend/worker/gc_heap.py: a serving process's start ends with its heap frozen. Each case runs in
a fresh interpreter, so this test worker's own heap is never frozen."""
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import gc, sys, weakref
from backend.worker.gc_heap import freeze_heap

class Node:
    pass

gc.disable()  # no collection but the one freeze_heap runs
kept = [[i] for i in range(100_000)]  # what a loaded model keeps
garbage = Node(); garbage.me = garbage; dead = weakref.ref(garbage); del garbage  # start-up garbage, in a cycle
frozen = freeze_heap()
walked = len(gc.get_objects())  # what a full collection walks from now on
print(frozen, walked, dead() is None)
"""


def test_the_start_up_garbage_goes_first_then_every_live_object_leaves_the_collectors_walks():
    run = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert run.returncode == 0, run.stderr
    frozen, walked, collected = run.stdout.split()
    assert collected == "True", "a cycle dropped before the freeze was frozen instead of collected"
    assert int(frozen) > 100_000, frozen
    assert int(walked) < 1_000, f"{walked} objects still walked by a full collection"
