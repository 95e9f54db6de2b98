"""Chat templates rendered in a jinja2 sandbox, bounded in time and size.

The template is the operator's (tokenizer_config.json or chat_template.jinja); requests may not
bring their own. Even so it runs in an ``ImmutableSandboxedEnvironment`` (no attribute access to
internals, no mutation of the inputs), every loop and call checks a deadline, and the rendered
text may not grow past a bound set by the input size, so a template bug cannot hang or flood the
server. A model without a template gets a plain ``role: content`` rendering.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from typing import Any, Iterable

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import APIError

RENDER_TIMEOUT_S = 1.0
MIN_OUTPUT_BOUND = 1 << 16  # characters allowed on top of a multiple of the input size
OUTPUT_FACTOR = 4


class TemplateError(APIError):
    def __init__(self, message: str) -> None:
        super().__init__(400, message, "invalid_request_error", "messages")


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def check(self) -> None:
        if time.monotonic() > self.at:
            raise TemplateError(f"the chat template took longer than {RENDER_TIMEOUT_S:g} s to render")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """A sandbox whose every call checks the render's deadline (set per render, per thread: renders
    run in worker threads, several at once)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._renders = threading.local()

    @property
    def deadline(self) -> _Deadline | None:
        return getattr(self._renders, "deadline", None)

    @deadline.setter
    def deadline(self, value: _Deadline | None) -> None:
        self._renders.deadline = value

    def call(self, __context, __obj, *args, **kwargs):
        if self.deadline is not None:
            self.deadline.check()
        return super().call(__context, __obj, *args, **kwargs)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """``tojson`` as Hugging Face's chat templates have it (keys in their order, no HTML escaping):
    the prompts the models were trained on."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(f"the chat template refused the conversation: {message}")


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str | None = None, eos_token: str | None = None) -> None:
        self.source = source
        self._env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
        self._env.filters["tojson"] = _tojson
        self._env.globals.update(raise_exception=_raise_exception,
                                 strftime_now=lambda fmt: datetime.now().strftime(fmt), range=self._range)
        self._template = self._env.from_string(source) if source else None
        self._specials = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    def _range(self, *args: int) -> Iterable[int]:
        """``range`` whose loops check the deadline, so an empty-bodied loop is bounded too."""
        for i, x in enumerate(range(*args)):
            if i % 1024 == 0 and self._env.deadline is not None:
                self._env.deadline.check()
            yield x

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, **template_kwargs: Any) -> str:
        """The prompt for ``messages``; ``tools`` (OpenAI's tool objects) and ``template_kwargs``
        (``enable_thinking``, ...) are the template's variables too."""
        if self._template is None:
            return _plain(messages, add_generation_prompt, tools)
        bound = MIN_OUTPUT_BOUND + OUTPUT_FACTOR * (sum(len(str(m.get("content") or "")) + len(str(m.get("tool_calls") or ""))
                                                        for m in messages) + len(str(tools or "")))
        deadline = _Deadline(RENDER_TIMEOUT_S)
        self._env.deadline = deadline
        out: list[str] = []
        size = 0
        try:
            for piece in self._template.generate(**template_kwargs, messages=messages, tools=tools,
                                                 add_generation_prompt=add_generation_prompt, **self._specials):
                size += len(piece)
                if size > bound:
                    raise TemplateError(f"the rendered chat template exceeded {bound} characters")
                deadline.check()
                out.append(piece)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template failed to render: {exc}") from None
        finally:
            self._env.deadline = None
        return "".join(out)


def _plain(messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list[dict] | None) -> str:
    """A model without a template: ``role: content`` lines, the tools and calls as JSON."""
    lines = [f"tools: {json.dumps(tools, ensure_ascii=False)}"] if tools else []
    for m in messages:
        calls = "".join(f" tool_call: {json.dumps(c['function'], ensure_ascii=False)}" for c in m.get("tool_calls") or ())
        lines.append(f"{m['role']}: {m.get('content') or ''}{calls}")
    return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
