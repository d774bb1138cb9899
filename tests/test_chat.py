"""Chat messages to prompt text: DeepSeek-R1's format (earlier answers lose their reasoning, the
generation prompt opens a <think> block), an HF directory's Jinja template, and one-line errors."""
from __future__ import annotations

import json

import pytest

from r1jax.data import chat


def test_r1_format():
    msgs = [{"role": "system", "content": "S1"}, {"role": "system", "content": "S2"},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
            {"role": "user", "content": [{"type": "text", "text": "and 3+3?"}]}]
    assert chat.Template().render(msgs) == (
        "<｜begin▁of▁sentence｜>S1\n\nS2<｜User｜>2+2?<｜Assistant｜>\n\n4<｜end▁of▁sentence｜>"
        "<｜User｜>and 3+3?<｜Assistant｜><think>\n")
    assert chat.Template().render(msgs[:3], add_generation_prompt=False).endswith("<｜User｜>2+2?")


def test_an_hf_directory_template_is_rendered_in_a_sandbox(tmp_path):
    jinja = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}" \
            "{% if add_generation_prompt %}[assistant]{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": jinja, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    t = chat.for_directory(tmp_path)
    assert t.name == "tokenizer_config.json"
    assert t.render([{"role": "user", "content": "hi"}]) == "<s>[user]hi[assistant]"
    evil = chat.Template("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(chat.ChatError, match="chat template failed"):
        evil.render([{"role": "user", "content": "x"}])
    assert chat.for_directory(tmp_path / "missing").name == "r1"


@pytest.mark.parametrize("messages,words", [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    ([{"role": "bot", "content": "x"}], "messages[0].role must be one of"),
    ([{"role": "user", "content": 3}], "messages[0].content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "content parts"),
])
def test_bad_messages_are_named(messages, words):
    with pytest.raises(chat.ChatError, match=words.replace("[", r"\[").replace("]", r"\]")):
        chat.Template().render(messages)
