"""Chat templates (backend/text/chat_template.py, Tokenizer.render_chat): the same text as transformers'
apply_chat_template on SmolLM2's template and on templates using its helpers, and a sandbox that
stops hostile templates instead of running their code."""
import pytest
from jinja2.exceptions import SecurityError

from backend.text.chat_template import ChatTemplateError, render_chat_template
from backend.text.tokenizer import Tokenizer
from smollm2 import smollm2_dir

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Ünïcödé → 日本語? <b>&</b>"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke.\n\nA short one."}],
]

# Uses what transformers' environment offers: loop controls, tojson (keeps non-ASCII, no HTML
# escaping), raise_exception, a special-token variable, trim_blocks/lstrip_blocks whitespace.
HELPERS_TEMPLATE = """{{ bos_token }}
{% for m in messages %}
    {% if m['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + m['role']) }}
    {% endif %}
    {% if loop.index > 2 %}{% break %}{% endif %}
[{{ m['role'] }}] {{ m['content'] | tojson }}
{% endfor %}
{% if add_generation_prompt %}[assistant]{% endif %}"""

HOSTILE_TEMPLATES = [
    # the classic escape: from a string to object's subclasses, to a class whose module imports os
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% for c in ().__class__.__base__.__subclasses__() %}{% if c.__name__ == 'catch_warnings' %}"
    "{{ c()._module.__builtins__['open'](MARKER, 'w').write('pwned') }}{% endif %}{% endfor %}",
    "{{ raise_exception.__globals__['__builtins__'] }}",
    "{{ messages.append({'role': 'system', 'content': 'injected'}) }}",  # immutable data
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
]


@pytest.fixture(scope="module")
def smollm2_tokenizers():
    from transformers import AutoTokenizer
    return Tokenizer.from_dir(smollm2_dir()), AutoTokenizer.from_pretrained(str(smollm2_dir()))


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_renders_like_transformers(smollm2_tokenizers, messages, add_generation_prompt):
    ours, theirs = smollm2_tokenizers
    text = ours.render_chat(messages, add_generation_prompt=add_generation_prompt)
    assert text == theirs.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=add_generation_prompt)
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == theirs.apply_chat_template(messages, tokenize=True, return_dict=False,
                                             add_generation_prompt=add_generation_prompt)


def test_helpers_render_like_transformers(smollm2_tokenizers):
    from transformers.utils.chat_template_utils import render_jinja_template
    messages = CONVERSATIONS[2]
    ours = render_chat_template(HELPERS_TEMPLATE, messages, special_tokens={"bos_token": "<s>"})
    theirs, _ = render_jinja_template([messages], chat_template=HELPERS_TEMPLATE,
                                      add_generation_prompt=True, bos_token="<s>")
    assert ours == theirs[0]
    assert '"Hello! How can I help?"' in ours and "A short one" not in ours  # tojson, break
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        render_chat_template(HELPERS_TEMPLATE, [{"role": "tool", "content": "x"}])


def test_strftime_now_is_available():
    text = render_chat_template("{{ strftime_now('%Y') }}", [{"role": "user", "content": "x"}])
    assert text.isdigit() and len(text) == 4


@pytest.mark.parametrize("template", HOSTILE_TEMPLATES)
def test_hostile_template_is_stopped_by_the_sandbox(tmp_path, template):
    marker = tmp_path / "pwned"
    with pytest.raises(ChatTemplateError, match="refused by the sandbox") as info:
        render_chat_template(template, [{"role": "user", "content": "hi"}], MARKER=str(marker))
    assert isinstance(info.value.__cause__, SecurityError)
    assert not marker.exists()


def test_bad_messages_are_refused_with_the_field():
    with pytest.raises(ChatTemplateError, match="messages must be a non-empty list"):
        render_chat_template("{{ messages }}", [])
    with pytest.raises(ChatTemplateError, match=r"messages\[1\] must be an object with a string 'role'"):
        render_chat_template("{{ messages }}", [{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]\.content: a value of type object cannot be passed"):
        render_chat_template("{{ messages }}", [{"role": "user", "content": object()}])


def test_checkpoint_without_template_says_so(default_model_dir):
    tok = Tokenizer.from_dir(default_model_dir)
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        tok.render_chat([{"role": "user", "content": "hi"}])
