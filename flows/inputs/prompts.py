"""Prompts: a Jinja template over a row's columns, optionally wrapped in the model's chat template.

The template sees each column by name, the whole row as `row` (for names that are not Python
identifiers: `{{ row["star rating"] }}`) and the flow's extra variables (annotate's `choices`).
Undefined names are errors, never empty strings, so a typo cannot silently empty a prompt; a
column that is null in a row renders as an empty string (not as "None").

With `chat: true` the rendered text becomes the user message, after an optional system message,
and the tokenizer's chat template renders the conversation with the assistant turn opened. The
engine then tokenizes that text as SGLang's engine does (with the tokenizer's special tokens).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta

from flows.config import PromptConfig

_ENV = jinja2.Environment(
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    finalize=lambda value: "" if value is None else value,
)


def template_names(template: str) -> set[str]:
    """The variables a template reads (jinja's undeclared names)."""
    return jinja2.meta.find_undeclared_variables(_ENV.parse(template))


def has_chat_template(tokenizer_path: str | Path) -> bool:
    """Whether a tokenizer folder ships a chat template (checked without loading the tokenizer)."""
    folder = Path(tokenizer_path)
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    config = folder / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def chat_template_text(tokenizer_path: str | Path) -> str:
    """Every chat template a tokenizer folder ships, as one text ("" if none): to read what the
    templates do (the tool-call format they teach), not to render."""
    folder = Path(tokenizer_path)
    texts = [p.read_text() for p in sorted(folder.glob("additional_chat_templates/*.jinja"))]
    if (folder / "chat_template.jinja").is_file():
        texts.append((folder / "chat_template.jinja").read_text())
    for name in ("chat_template.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            template = json.loads((folder / name).read_text()).get("chat_template")
            # (a list of named templates: [{"name": "tool_use", "template": "..."}, ...])
            named = template if isinstance(template, list) else [{"template": template}]
            texts += [t["template"] for t in named if isinstance(t.get("template"), str)]
    return "\n".join(texts)


# tokenizer.apply_chat_template, or a resident engine's (which renders with its own tokenizer):
# called with a list of conversations, tokenize=False and add_generation_prompt=True
ChatTemplate = Callable[..., Any]


class PromptRenderer:
    def __init__(
        self,
        prompt: PromptConfig,
        variables: dict[str, Any],
        chat_template: ChatTemplate | None,
        image_placeholder: str | None = None,
    ) -> None:
        self.template = _ENV.from_string(prompt.template) if prompt.template is not None else None
        self.globals = dict(self.template.globals) if self.template is not None else {}
        self.messages_column = prompt.messages_column  # chat rows: no template
        self.chat = prompt.uses_chat_template
        self.system = prompt.system
        self.variables = variables
        self.chat_template = chat_template
        if self.chat and chat_template is None:
            raise ValueError("prompt.chat needs the tokenizer's chat template")
        # rows with an image (prompt.image_column): the model's image slot, where the template
        # writes {{ image }}, else before the text; a row without one gets neither (image_column.py)
        self.image_column = prompt.image_column if image_placeholder is not None else None
        self.image_placeholder = image_placeholder or ""
        self.image_first = "image" not in template_names(prompt.template or "")

    def render(self, row: dict[str, Any]) -> str:
        return self.render_many([row])[0]

    def _render(self, row: dict[str, Any]) -> str:
        if self.image_column is None:
            return self._fill({**self.globals, **row, "row": row, **self.variables})
        image = self.image_placeholder if row.get(self.image_column) else ""
        text = self._fill({**self.globals, **row, "row": row, **self.variables, "image": image})
        return image + text if self.image_first else text

    def _fill(self, names: dict[str, Any]) -> str:
        """`template.render(names)`, with the template's globals already in `names`.

        NOTE: render() copies the globals into a new dict for every row, a third of a short
        template's time; a context made with shared=True takes `names` as they are, so the
        result is render()'s as long as `names` starts with the globals (as _render's do)."""
        template = self.template
        context = template.new_context(names, shared=True)
        return template.environment.concat(template.root_render_func(context))

    def render_many(self, rows: list[dict[str, Any]]) -> list[str]:
        """The prompts of rows; the chat template renders them all in one call (one round
        trip when a resident engine renders them)."""
        if not rows:
            return []
        system = [{"role": "system", "content": self.system}] if self.system else []
        if self.messages_column is not None:
            conversations = [self._conversation(row, system) for row in rows]
        else:
            texts = [self._render(row) for row in rows]
            if not self.chat:
                return texts
            conversations = [[*system, {"role": "user", "content": text}] for text in texts]
        assert self.chat_template is not None
        return list(self.chat_template(conversations, tokenize=False, add_generation_prompt=True))

    def _conversation(self, row: dict[str, Any], system: list[dict[str, str]]) -> list[dict]:
        """A chat row's messages, the config's system message first where it has none."""
        messages = chat_messages(row.get(self.messages_column))
        has_system = any(m["role"] == "system" for m in messages)
        return messages if has_system else [*system, *messages]


CHAT_ROLES = ("system", "user", "assistant", "tool")


def chat_messages(value: Any) -> list[dict[str, Any]]:
    """A cell of prompt.messages_column as a list of {role, content} (a JSON string too, as a
    CSV holds it); keys a message lacks, which Parquet and JSONL give as nulls, are dropped.
    ValueError saying what is wrong."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON ({e.msg})") from None
    if not isinstance(value, list) or not value:
        raise ValueError("not a list of messages ({role, content})")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise ValueError(f"message {i} is {type(message).__name__}, not {{role, content}}")
        message = {k: v for k, v in message.items() if v is not None}
        if message.get("role") not in CHAT_ROLES:
            raise ValueError(
                f"message {i} has role {message.get('role')!r}; roles: {', '.join(CHAT_ROLES)}"
            )
        if not isinstance(message.get("content"), str):
            raise ValueError(f"message {i} has no text content")
        messages.append(message)
    return messages
