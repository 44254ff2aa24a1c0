"""Chat templates: a conversation rendered as the model expects it, as transformers renders it.

The template is a model's Jinja `chat_template` (tokenizer_config.json, chat_template.jinja or
the GGUF); it runs sandboxed, with the helpers HF templates call (raise_exception, tojson,
strftime_now). `Tokenizer.apply_chat_template` fills in the special tokens and calls this.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Sequence


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (its `raise_exception`) or failed to render."""


def render_chat_template(
    template: str, messages: Sequence[dict], *, add_generation_prompt: bool = True, **context: Any
) -> str:
    """The conversation as text; context: the special tokens and whatever else the template reads."""
    import jinja2

    try:
        return _compile(template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **context
        )
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e


_COMPILED: dict[str, Any] = {}


def _compile(template: str):
    """A sandboxed Jinja template with the helpers HF chat templates call."""
    if template not in _COMPILED:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            import jinja2

            raise jinja2.exceptions.TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(
                value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
            )

        # trim_blocks/lstrip_blocks as transformers sets them: templates are written for these
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _COMPILED[template] = env.from_string(template)
    return _COMPILED[template]
