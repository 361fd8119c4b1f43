"""The KV tiers' GPU path rehearsed on the CPU (tests/fake_cuda.py: torch.cuda answers as an H200
would, the tensors stay on the CPU, streams and events are recorded in order): the host pool is
asked for pinned memory; every copy runs on the copy stream after it waited for the compute
stream; the compute stream waits for the saves before the step that overwrites their blocks; a
request whose prefix is still being copied back runs no row while other requests keep stepping,
and once the copy's event completes it runs with the tokens of an engine without tiers."""
import pytest

from backend import LLM, SamplingParams
from fake_cuda import FakeCuda

ON_GPU = dict(device="cuda:0", attention_backend="torch", enforce_eager=True, kv_block_size=16,
              max_tokens_in_paged_kv_cache=80, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64)
FIRST = list(range(10, 50))            # 2 full blocks and a partial one
OTHER = list(range(100, 160))          # needs the whole cache: FIRST's cached blocks are handed out
RETURNING = FIRST + [7, 8, 9, 11, 12]  # FIRST's prefix again, after it left the cache
SHORT = [200, 201, 202]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    cuda = FakeCuda().install(monkeypatch)
    monkeypatch.setenv("INFLIGHT_LOCK_DIR", str(tmp_path))
    return cuda


def instrument(llm, cuda):
    """Record the model runs and the copies in the fake's timeline, with the stream they run on."""
    runner = llm.engine.runner
    compute, gather, scatter = runner._compute, runner.kv_copier._gather, runner.kv_copier._scatter
    runner._compute = lambda *a: (cuda.timeline.append(("forward", cuda.now)), compute(*a))[1]
    runner.kv_copier._gather = lambda saves: (cuda.timeline.append(("gather", cuda.now, saves)), gather(saves))[1]
    runner.kv_copier._scatter = lambda loads: (cuda.timeline.append(("scatter", cuda.now, loads)), scatter(loads))[1]


@pytest.mark.slow
def test_copies_run_on_their_stream_from_pinned_memory_in_order(gpu, default_model_dir):
    reference = LLM(str(default_model_dir), **ON_GPU)
    want = [o.token_ids for o in reference.generate([FIRST, OTHER, RETURNING], GREEDY)]
    llm = LLM(str(default_model_dir), kv_host_cache_bytes=1 << 20, **ON_GPU)
    copier = llm.engine.runner.kv_copier
    assert gpu.pinned == [copier.num_slots * copier.block_bytes]  # the host pool is page-locked
    instrument(llm, gpu)
    gpu.timeline.clear()
    assert [o.token_ids for o in llm.generate([FIRST, OTHER], GREEDY)] == want[:2]
    t = gpu.timeline
    gathers = [i for i, e in enumerate(t) if e[0] == "gather"]
    assert gathers, "FIRST's cached blocks were handed out without being saved"
    for i in gathers:
        assert t[i][1] is copier.stream  # on the copy stream, not the compute stream
        enter = max(j for j in range(i) if t[j][0] == "enter")
        assert t[enter + 1] == ("wait_stream", copier.stream, gpu.compute)  # after the steps that wrote them
        record = next(j for j in range(i, len(t)) if t[j][0] == "record")
        wait = next(j for j in range(record, len(t)) if t[j][0] == "wait_event")
        forward = next(j for j in range(i, len(t)) if t[j][0] == "forward")
        # the compute stream waits for the saves' event before the step that overwrites the blocks
        assert t[wait] == ("wait_event", gpu.compute, t[record][1]) and record < wait < forward
    assert all(e[1] is gpu.compute for e in t if e[0] == "forward")

    # FIRST's prefix comes back: its copy is held in flight, and meanwhile SHORT keeps decoding
    gpu.hold_events = True
    returning = llm.engine.add_request("returning", RETURNING, GREEDY)
    short = llm.engine.add_request("short", SHORT, GREEDY)
    for _ in range(4):
        llm.engine.step()
    assert returning.kv_load is not None and returning.kv_load.issued and not returning.output_token_ids
    assert len(short.output_token_ids) >= 3  # never paused by another request's copy
    scatters = [e for e in t if e[0] == "scatter"]
    assert scatters and all(e[1] is copier.stream for e in scatters)
    assert [b for _, b in scatters[-1][2]] == llm.engine.blocks.block_table("returning")[:2]
    gpu.hold_events = False
    gpu.release_events()
    while llm.engine.has_work():
        llm.engine.step()
    assert returning.output_token_ids == want[2]  # the bytes that came back are the ones computed
    assert returning.num_cached_tokens == 32
    assert llm.stats()["kv_tiers"]["host"]["hits"] == 2
    llm.check_integrity()
    assert llm.stats()["kv_blocks_used"] == 0 and not any(llm.engine.kv_tiers.host.pins)


def test_a_load_given_up_mid_copy_is_waited_for_before_its_blocks_are_written(gpu, default_model_dir):
    llm = LLM(str(default_model_dir), kv_host_cache_bytes=1 << 20, **ON_GPU)
    instrument(llm, gpu)
    llm.generate([FIRST, OTHER], GREEDY)
    gpu.hold_events = True
    llm.engine.add_request("returning", RETURNING, GREEDY)
    llm.engine.step()  # the load is issued, its event pending
    load = llm.engine.scheduler.running[0].kv_load
    assert load is not None and load.issued and not load.done
    llm.engine.abort("returning")  # its blocks are free again while the copy into them runs
    gpu.timeline.clear()
    llm.engine.add_request("other", OTHER[:40], GREEDY)
    llm.engine.step()
    t = gpu.timeline
    forward = next(i for i, e in enumerate(t) if e[0] == "forward")
    assert ("wait_event", gpu.compute, load.handle) in t[:forward]
    gpu.hold_events = False
    gpu.release_events()
    while llm.engine.has_work():
        llm.engine.step()
    llm.engine.kv_tiers.poll()
    llm.check_integrity()
    assert not llm.engine.kv_tiers.busy and not any(llm.engine.kv_tiers.host.pins)


@pytest.mark.slow
def test_the_gpu_check_of_the_tiers_passes_its_cpu_rehearsal(tmp_path):
    """client/tools/gpu_check/kv_tiers.py, the check a GPU session runs first, rehearsed on the CPU."""
    import json

    from client.tools.gpu_check.kv_tiers import main

    assert main(["--dry-run", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "kv_tiers.json").read_text())
    assert res["copies"]["exact"] and res["chat"]["host"]["host_hits"] > 0 and res["chat"]["host"]["idle"]
    # a model of several KV-cache groups (Gemma 3's sliding-window layers) through the same tier
    assert res["chat"]["host"]["kv_groups"] == 1 and res["groups"]["host"]["kv_groups"] == 3  # a global layer, two local ones: a group each
    assert res["groups"]["host"]["host_hits"] > 0 and res["groups"]["host"]["idle"] and res["groups"]["none"]["idle"]
