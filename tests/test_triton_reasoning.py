"""The Triton door's reasoning split (the `reasoning_parser` input, the `reasoning_output` output),
without a server: off by default; on, the thinking goes to reasoning_output and text_output keeps
the answer, streamed (a tag cut across responses never reaches either) and not (the prompt still
in front of the answer when exclude_input_in_output is false); a bad name is refused."""
from types import SimpleNamespace

import numpy as np
import pytest
from adapter_module import load_adapter

load_adapter()  # puts the adapter's folder on sys.path
import triton_inputs  # noqa: E402
from live_request import Live  # noqa: E402
from triton_outputs import output_tensors  # noqa: E402

PIECES = ["<thi", "nk>I think", " so</th", "ink>\n\nYes", "."]


def live(stream, reasoning="qwen3", exclude=True):
    return Live(key="k", client_id="", sender=None, stream=stream, exclude_input=exclude, prompt_text="Q: ",
                arrival=0.0, reasoning=reasoning)


def output(new_text, text, finish=None):
    return SimpleNamespace(new_text=new_text, text=text, new_token_ids=[1] * len(new_text),
                           token_ids=[1] * len(text), prompt_token_ids=[5, 6], finish_reason=finish,
                           logprobs=None, new_logprobs=None, cumulative_logprob=None)


def texts(tensors, name):
    return [v.decode() for v in tensors[name]]


def test_streamed_the_pieces_split_and_no_tag_leaks():
    lv, thought, answer = live(stream=True), [], []
    for i, piece in enumerate(PIECES):
        out = output(piece, "".join(PIECES[:i + 1]), "stop" if i == len(PIECES) - 1 else None)
        lv.latest[0] = out
        tensors = output_tensors(lv, {0: out}, lambda ids: "")
        thought += texts(tensors, "reasoning_output")
        answer += texts(tensors, "text_output")
    assert ("".join(thought), "".join(answer)) == ("I think so", "Yes.")
    assert not any("<" in piece or ">" in piece for piece in thought + answer)


def test_whole_the_prompt_stays_in_front_of_the_answer_and_it_is_off_by_default():
    whole = "".join(PIECES)
    lv = live(stream=False, exclude=False)
    lv.latest[0] = output(whole, whole, "stop")
    tensors = output_tensors(lv, {}, lambda ids: "")
    assert texts(tensors, "reasoning_output") == ["I think so"] and texts(tensors, "text_output") == ["Q: Yes."]
    plain = live(stream=False, reasoning=None)
    plain.latest[0] = output(whole, whole, "stop")
    tensors = output_tensors(plain, {}, lambda ids: "")
    assert "reasoning_output" not in tensors and texts(tensors, "text_output") == [whole]


def test_deepseek_r1_starts_inside_the_thinking():
    lv = live(stream=False, reasoning="deepseek_r1")
    lv.latest[0] = output("", "x</think>y", "stop")
    tensors = output_tensors(lv, {}, lambda ids: "")
    assert (texts(tensors, "reasoning_output"), texts(tensors, "text_output")) == (["x"], ["y"])


def test_the_input_takes_vllms_names_only():
    text = np.array([b"hi"], dtype=np.object_)
    parsed = triton_inputs.parse_request({"text_input": text, "reasoning_parser": np.array([b"qwen3"], dtype=np.object_)})
    assert parsed.reasoning_parser == "qwen3"
    assert triton_inputs.parse_request({"text_input": text}).reasoning_parser is None
    with pytest.raises(ValueError, match="reasoning_parser must be one of qwen3, deepseek_r1"):
        triton_inputs.parse_request({"text_input": text, "reasoning_parser": np.array([b"r1"], dtype=np.object_)})
