"""Images under tensor parallelism (docs/vision.md, docs/parallelism.md): the tiny Gemma 3 vision
checkpoint (tests/vision_checkpoint.py) at tensor_parallel_size 2 on this CPU, with a real worker
process, answers token for token as the same engine with one rank does, for one and two images of
different sizes beside text-only prompts, whole and chunked, and again with the same images (the
encoder cache and the prefix cache). Rank 0 alone runs the encoder: every image is encoded once,
and each step with image rows sends them to rank 1 in one broadcast (through shared memory, or
gloo with INFLIGHT_TP_SHM=0); the step message carries no pixels to the ranks."""
import dataclasses

import numpy as np
import pytest

from backend import LLM, SamplingParams
from backend.core.multimodal import ImageItem
from backend.core.step import NewSeq, StepPlan
from backend.worker.parallel.step_message import STEP, StepMessage, decode, encode
from vision_checkpoint import BOI, make_vision_checkpoint, random_image

CASES = [  # (token prompt with a BOI per image, images, max_tokens): lengths not block multiples
    ([5, 6, BOI, 7, 8, 9], [random_image(1, 30, 40)], 7),
    ([40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58], [], 6),
    ([11, BOI, 12, 13, BOI, 14], [random_image(2, 64, 48, "L"), random_image(3, 48, 48, "RGBA")], 8),
    ([20, 21, 22, BOI, 23, 24, 25, 26, 27, 28, 29, 30, 31], [random_image(4, 17, 90)], 5),
]


def prompts(cases):
    return [{"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids
            for ids, images, _ in cases]


def params(cases):
    return [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for *_, n in cases]


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory):
    return make_vision_checkpoint(tmp_path_factory.mktemp("gemma3-vision-tp"), seed=3)


@pytest.mark.slow  # a one-rank engine and a two-rank one with its worker process: ~15 s each
@pytest.mark.parametrize("chunked,shm", [(True, True), (False, False)])
def test_tp2_with_images_answers_as_one_rank(vision_dir, monkeypatch, chunked, shm):
    if not shm:
        monkeypatch.setenv("INFLIGHT_TP_SHM", "0")   # the rows through gloo's broadcast
    kw = dict(max_model_len=256, kv_block_size=16, max_tokens_in_paged_kv_cache=2048,
              enable_chunked_context=chunked, max_num_batched_tokens=16 if chunked else 512)
    again = [CASES[2], CASES[0]]   # the same images again: rank 0's encoder cache or the prefix cache
    one = LLM(str(vision_dir), **kw)
    expected = [o.token_ids for o in one.generate(prompts(CASES), params(CASES))]
    expected_again = [o.token_ids for o in one.generate(prompts(again), params(again))]
    with LLM(str(vision_dir), tensor_parallel_size=2, **kw) as two:
        got = [o.token_ids for o in two.generate(prompts(CASES), params(CASES))]
        got_again = [o.token_ids for o in two.generate(prompts(again), params(again))]
        stats, runner = two.stats(), two.engine.runner
        calls = runner.tp.stats()["calls"]
        assert (runner.tp.shm is not None) == shm
    assert got == expected and got_again == expected_again
    assert stats["encoder_runs_total"] == 4 and stats["kv_blocks_used"] == 0
    # one broadcast per step with image rows: at least one per image (chunked: a chunk holds at most one)
    assert calls["broadcast"] >= (4 if chunked else 1) and calls["broadcast"] < calls["step_message"]


def test_the_step_message_carries_no_pixels_to_the_ranks():
    pixels = np.ones((3, 48, 48), np.float32)
    item = ImageItem(hash="ab" * 32, offset=3, length=9, pixel_values=pixels)
    seq = NewSeq(seq_id="r1", prompt_token_ids=[1, 2, 3] + [500] * 9, output_token_ids=[], params=SamplingParams(),
                 seed=0, index=0, eos_token_ids=(2,), bad_words_ids=[], lora_name=None, block_tables=([0],),
                 num_computed_tokens=0, mm_items=(item,))
    plan = StepPlan(new_seqs=[seq, dataclasses.replace(seq, seq_id="r2", mm_items=())])
    header, payload = encode(StepMessage(STEP, 0, plan))
    sent = decode(header, payload).plan
    assert payload.nbytes < pixels.nbytes / 4   # the pixels stay on rank 0
    (got,) = sent.new_seqs[0].mm_items
    assert got.pixel_values is None and (got.hash, got.offset, got.length) == (item.hash, 3, 9)
    assert sent.new_seqs[1].mm_items == () and plan.new_seqs[0].mm_items[0].pixel_values is pixels


def test_qwen2_5_vl_under_tensor_parallelism_is_refused_by_name(tmp_path):
    """Its image steps' M-RoPE rows are rank 0's alone: refused at start, before any rank loads."""
    import json

    from backend.core.config import EngineConfig
    from backend.worker.parallel.vision import vision_step
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2_5_VLForConditionalGeneration"]}))
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 with a Qwen2.5-VL checkpoint is not supported yet"):
        vision_step(EngineConfig(model_path=str(tmp_path)), object(), None, True)
