"""templates/llm/config.pbtxt and `inflight config`: every EngineConfig field documented with its
real default, a valid Triton config, the right instance group, and hand edits kept."""
import dataclasses
import re

import pytest

from backend.core.config import EngineConfig
from templates import render as R

FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
DEFAULT = EngineConfig()


def body(text):
    return text.split("\n", 1)[1]


def test_every_engine_parameter_is_in_the_template_with_its_default_and_a_comment():
    text = R.TEMPLATE.read_text()
    params = R.read_parameters(R.render(gpus=[]))
    assert set(params) == set(FIELDS), "template parameters must be exactly the EngineConfig fields"
    parsed = EngineConfig.from_params({k: v for k, v in params.items() if k != "model_path"})
    for name in FIELDS:
        if name != "model_path":
            assert getattr(parsed, name) == getattr(DEFAULT, name), f"{name}: template default differs"
        # A comment block naming the parameter, with a default and a range, right above it.
        block = re.search(rf"# {name}: (.+?)\nparameters {{ key: \"{name}\"", text, re.S)
        assert block, f"{name} has no comment block above it"
        assert "default" in block.group(1), f"{name}: comment gives no default"
    assert params["model_path"] == "models/smollm2-135m-instruct-q4_1"  # what `make model` writes


def test_rendered_config_is_a_valid_decoupled_triton_config():
    config = R.parse_config(body(R.render(gpus=[])))
    assert config.name == "llm" and config.backend == "python" and config.max_batch_size == 0
    assert config.model_transaction_policy.decoupled
    names = {i.name for i in config.input}
    assert {"text_input", "input_ids", "max_tokens", "stream", "temperature", "top_k", "top_p", "seed",
            "stop_words", "ignore_eos", "min_tokens", "exclude_input_in_output", "stop"} <= names
    assert all(i.optional for i in config.input)
    assert [o.name for o in config.output] == ["text_output", "output_ids", "finish_reason", "cumulative_logprob",
                                               "logprobs", "num_input_tokens", "num_output_tokens",
                                               "num_cached_tokens", "queue_position", "reserved_step", "engine_step", "first_scheduled_step",
                                               "kv_blocks_reserved", "arrival_time_ns", "first_scheduled_time_ns",
                                               "first_token_time_ns", "finished_time_ns", "seconds_since_arrival",
                                               "expected_wait_seconds",
                                                   "prompt_logprobs", "reasoning_output", "cum_log_probs", "output_log_probs",
                                                   "embedding"]


def test_instance_group_gpu_where_gpus_exist_cpu_where_none():
    cpu = R.parse_config(body(R.render(gpus=[]))).instance_group
    assert len(cpu) == 1 and cpu[0].kind == cpu[0].KIND_CPU and not cpu[0].gpus
    gpu = R.parse_config(body(R.render(gpus=[0, 1], count=2))).instance_group
    assert gpu[0].kind == gpu[0].KIND_GPU and list(gpu[0].gpus) == [0, 1] and gpu[0].count == 2


def test_detect_gpus_finds_none_on_a_machine_without_any():
    import shutil

    import torch
    if shutil.which("nvidia-smi") or torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    assert R.detect_gpus() == []
    assert "KIND_CPU" in R.parse_config(body(R.render())).instance_group[0].__str__()


def test_overrides_change_only_their_value_and_keep_comments():
    text = R.render(gpus=[])
    edited = R.apply_overrides(text, {"max_num_seqs": "8", "model_path": "/m/x", "new_key": 'a"b'})
    params = R.read_parameters(edited)
    assert params["max_num_seqs"] == "8" and params["model_path"] == "/m/x" and params["new_key"] == 'a"b'
    assert edited.count("\n") == text.count("\n") + 1
    assert "# max_num_seqs: the most requests" in edited
    # Tolerates a hand-formatted block too.
    hand = 'parameters {\n  key: "max_num_seqs"\n  value: {\n    string_value: "64"\n  }\n}\n'
    assert R.read_parameters("name: \"llm\"\n" + R.apply_overrides(hand, {"max_num_seqs": "2"})) == {"max_num_seqs": "2"}


def test_write_config_keeps_hand_edits_unless_forced(tmp_path):
    out = tmp_path / "llm" / "config.pbtxt"
    assert R.write_config(out, gpus=[]) == "written"
    assert R.write_config(out, gpus=[]) == "unchanged"
    assert not R.is_hand_edited(out.read_text())
    edited = out.read_text().replace('string_value: "64"', 'string_value: "4"')
    out.write_text(edited)
    assert R.is_hand_edited(edited)
    assert R.write_config(out, gpus=[]) == "kept" and out.read_text() == edited
    assert R.read_parameters(out.read_text())["max_num_seqs"] == "4"
    assert R.write_config(out, gpus=[], force=True) == "written"
    assert R.read_parameters(out.read_text())["max_num_seqs"] == "64"


def test_cli_config_renders_with_params(tmp_path, capsys):
    from client.cli import main
    out = tmp_path / "config.pbtxt"
    assert main(["config", "--output", str(out), "--cpu", "--param", "max_num_seqs=3"]) == 0
    assert R.read_parameters(out.read_text())["max_num_seqs"] == "3"
    assert "KIND_CPU" in out.read_text()
    out.write_text(out.read_text() + "\n# mine\n")
    assert main(["config", "--output", str(out), "--cpu"]) == 0
    assert "hand edits" in capsys.readouterr().out and out.read_text().endswith("# mine\n")


def test_bad_param_syntax_is_refused():
    with pytest.raises(Exception):
        R.parse_param("novalue")


def test_configuration_docs_give_every_parameter_with_its_default():
    """docs/configuration.md's parameter table (the README's before issue 42 moved it) gives each
    parameter's template default."""
    doc = (R.REPO_ROOT / "docs" / "configuration.md").read_text()
    doc = doc[doc.index("## Parameters"):]
    params = R.read_parameters(R.render(gpus=[]))
    for name, value in params.items():
        row = re.search(rf"^\| `{name}` \| `?([^|`]+?)`? \|", doc, re.M)
        assert row, f"docs/configuration.md's parameter table has no row for {name}"
        assert row.group(1) == (value or '""'), \
            f"docs/configuration.md gives {name} default {row.group(1)}, the template {value}"


def test_a_kept_config_older_than_the_checkout_is_named_with_what_it_lacks(tmp_path):
    """A hand-edited config.pbtxt from before an output was added is kept, and both `inflight config`
    and `inflight serve` say which tensors it lacks (clients asking for them would fail)."""
    from templates import tensors
    from templates.render import render, stale_warning, write_config

    fresh = render([], 1)
    assert stale_warning(tmp_path / "c", fresh) is None
    newest = tensors.OUTPUTS[-1].name
    old = "\n".join(line for line in fresh.splitlines() if f'"{newest}"' not in line) + "\n# edited\n"
    path = tmp_path / "config.pbtxt"
    path.write_text(old)
    assert write_config(path, gpus=[]) == "kept"
    warning = stale_warning(path, path.read_text())
    assert warning is not None and newest in warning and "--force" in warning
