"""Chat messages to prompt text: DeepSeek-R1's format, or an HF directory's own template.

R1's format (its tokenizer_config.json `chat_template`, the revision of February 2025): the BOS
token, the system messages joined by blank lines, then `<｜User｜>` + content per user turn and
`<｜Assistant｜>` + content + `<｜end▁of▁sentence｜>` per assistant turn, where an earlier
assistant turn keeps only what follows its `</think>` (the template drops past reasoning); the
generation prompt is `<｜Assistant｜><think>\\n`, so the model starts inside its reasoning.

r1jax's own tokenizers use this format (it is what the model family is trained on). An HF
directory whose tokenizer_config.json carries a `chat_template` is rendered with that Jinja
template in a sandbox, with its `bos_token` and `eos_token`, as transformers renders it.
"""
from __future__ import annotations

import json
from pathlib import Path

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
# R1's format's markers: a tokenizer r1jax trains for chat data keeps each one a single token.
# The think tags are ordinary (non-special) tokens, as in DeepSeek's tokenizer: decoded text keeps
# them, which the format and accuracy rewards read.
MARKERS = (BOS, EOS, USER, ASSISTANT)
THINK = ("<think>", "</think>")
ROLES = ("system", "user", "assistant")


class ChatError(ValueError):
    """A message list the template cannot render; the message names what is wrong."""


def check(messages) -> list[dict]:
    """`messages` as [{role, content}] with a known role and string content, or a ChatError."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatError(f"messages[{i}] must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ChatError(f"messages[{i}].role must be one of {', '.join(ROLES)}, not {role!r}")
        if isinstance(content, list):        # OpenAI's content parts: text parts only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ChatError(f"messages[{i}].content parts must be {{'type': 'text', 'text': str}}")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ChatError(f"messages[{i}].content must be a string")
        out.append({"role": role, "content": content})
    return out


def render_r1(messages: list[dict], add_generation_prompt: bool = True) -> str:
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    parts = [BOS, system]
    for m in messages:
        if m["role"] == "user":
            parts.append(USER + m["content"])
        elif m["role"] == "assistant":
            answer = m["content"].split("</think>")[-1]
            parts.append(ASSISTANT + answer + EOS)
    if add_generation_prompt:
        parts.append(ASSISTANT + "<think>\n")
    return "".join(parts)


class Template:
    """Renders messages to the prompt text a model expects."""

    def __init__(self, jinja: str | None = None, bos: str = BOS, eos: str = EOS):
        self.jinja, self.bos, self.eos = jinja, bos, eos
        self._compiled = None
        if jinja is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(msg):
                raise ChatError(msg)
            env.globals["raise_exception"] = raise_exception
            self._compiled = env.from_string(jinja)

    @property
    def name(self) -> str:
        return "r1" if self.jinja is None else "tokenizer_config.json"

    def render(self, messages, add_generation_prompt: bool = True) -> str:
        messages = check(messages)
        if self._compiled is None:
            return render_r1(messages, add_generation_prompt)
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos, eos_token=self.eos)
        except ChatError:
            raise
        except Exception as e:                         # a template error is the request's
            raise ChatError(f"the chat template failed on these messages: {e}") from None


def _token_text(v) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


def for_directory(d: Path | None) -> Template:
    """The template of an HF directory's tokenizer_config.json when it has one, else R1's."""
    cfg = None if d is None else d / "tokenizer_config.json"
    if cfg is not None and cfg.is_file():
        c = json.loads(cfg.read_text())
        if isinstance(c.get("chat_template"), str):
            return Template(c["chat_template"], _token_text(c.get("bos_token")) or "",
                            _token_text(c.get("eos_token")) or "")
    return Template()
