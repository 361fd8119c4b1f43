"""client/tools/quality/question_set.py: the question file, the lenient match, and one measuring run of two
storages of the tiny random-weight model (given a chat template of its own)."""
import json
import shutil

import pytest

from client.tools.quality import question_set as qs
def test_the_checked_in_question_file_has_twenty_or_more_answerable_questions():
    questions = qs.load_questions()
    assert len(questions) >= 20
    assert len({q.question for q in questions}) == len(questions)
    assert all(q.question.endswith("?") and all(a.strip() for a in q.answers) for q in questions)


def test_a_bad_row_is_refused_naming_its_line(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question": "Q?", "answers": ["a"]}\n{"question": "No answers?", "answers": []}\n')
    with pytest.raises(ValueError, match=r"q.jsonl:2: needs a question and a non-empty list of answers"):
        qs.load_questions(path)


@pytest.mark.parametrize("reply, answers, right", [
    ("The capital of France is Paris.", ["Paris"], True),
    ("paris, of course", ["Paris"], True),          # case ignored
    ("Parisian cafés are lovely.", ["Paris"], False),  # a whole word, not a prefix
    ("There are 17 of them.", ["seven", "7"], False),
    ("A week has 7 days.", ["seven", "7"], True),
    ("There are 7,982 of them.", ["seven", "7"], False),  # a whole number, not its first digits
    ("It costs 0.7 dollars.", ["7"], False),
    ("It freezes at 0.", ["0", "zero"], True),          # a full stop ends a sentence, not a number
    ("Plants take in carbon dioxide.", ["carbon dioxide", "CO2"], True),
    ("Plants take in carbon.", ["carbon dioxide", "CO2"], False),
    ("It is H2O.", ["H2O"], True),
    ("", ["Paris"], False),
])
def test_lenient_match(reply, answers, right):
    assert qs.is_right(reply, answers) is right


def test_variant_spec_parses_folder_and_engine_parameters():
    v = qs.parse_variant("bf16=models/x,dtype=bfloat16,max_num_seqs=4")
    assert (v.name, v.model_path, v.params) == ("bf16", "models/x", {"dtype": "bfloat16", "max_num_seqs": "4"})
    with pytest.raises(Exception, match="NAME=FOLDER"):
        qs.parse_variant("models/x")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, default_model_dir):
    folder = tmp_path_factory.mktemp("chat") / "tiny"
    shutil.copytree(default_model_dir, folder)
    config = folder / "tokenizer_config.json"
    data = json.loads(config.read_text()) if config.exists() else {}
    data["chat_template"] = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    config.write_text(json.dumps(data))
    return folder


def test_one_run_measures_every_variant_and_the_table_shows_them(chat_model):
    questions = [qs.Question("What is the capital of France?", ("Paris",)), qs.Question("Say hi?", ("hi",))]
    variants = [qs.Variant("bf16", str(chat_model), {"dtype": "bfloat16"}), qs.Variant("float32", str(chat_model))]
    text = "Alice was beginning to get very tired of sitting by her sister on the bank. " * 8
    rows = qs.measure(variants, questions, text, ctx=32, max_tokens=6, speed_tokens=5, rounds=2, log=lambda *_: None)
    assert [r["name"] for r in rows] == ["bf16", "float32"]
    for row in rows:
        assert row["speed_tokens"] == 2 * 5 and row["tok_s"] > 0
        assert 1 < row["perplexity"] < 1e6
        assert [r["question"] for r in row["replies"]] == [q.question for q in questions]
        assert row["right"] == sum(qs.is_right(r["reply"], q.answers) for r, q in zip(row["replies"], questions))
    assert rows[0]["weight_mb"] < rows[1]["weight_mb"]  # bf16 holds half the bytes
    table = qs.markdown(rows)
    assert "| bf16 |" in table and "| float32 |" in table and "+0.00%" in table and "1.00x" in table
    assert "| What is the capital of France? |" in table
