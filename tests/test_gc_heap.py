"""backend/core/gc_heap.py: a serving process's start ends with its heap frozen. Each case runs in
a fresh interpreter, so this test worker's own heap is never frozen."""
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import gc, sys, weakref
from backend.core.gc_heap import freeze_heap

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


def test_the_openai_server_freezes_its_heap_before_it_serves(monkeypatch, tmp_path):
    """`python -m openai_server`'s main: the app built (tokenizer, chat template, routes), the heap is
    frozen when uvicorn starts serving it."""
    import gc

    import uvicorn

    from backend.models.make_model import make_model
    from openai_server.__main__ import main

    make_model(tmp_path / "model")  # the tests' small checkpoint, with its tokenizer

    seen = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.append(gc.get_freeze_count()))
    try:
        assert main(["--grpc-url", "127.0.0.1:1", "--model-path", str(tmp_path / "model")]) == 0
    finally:
        gc.unfreeze()  # this test worker's heap goes back as it was
    assert seen and seen[0] > 10_000, seen
