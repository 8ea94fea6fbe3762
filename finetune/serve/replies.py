"""Generated text -> OpenAI's assistant message: tool calls, reasoning (`reasoning_content`) and content.

The text is read with transformers' own response parser (`transformers.utils.chat_parsing.parse_response`,
declarative `response_template` specs): the tokenizer's `response_template` where it ships one, else a spec
for the tool-call format its chat template writes, recognised from the template's source, as
`finetune.data.chat.template_reads` recognises the fields it reads:

- Hermes / Qwen (`<tool_call>` in the template): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them;
- Mistral (`[TOOL_CALLS]`): `[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": ...}]`; a call the model
  wrote without an id gets 9 letters and digits, the only ids Mistral's template renders when the client sends
  the call back (as vLLM's Mistral ids; an OpenAI-style `call_...` id made the next turn a 400);
- Llama 3.1 / 3.2 (`"parameters"` in a `<|start_header_id|>` template): the whole reply is one
  `{"name": ..., "parameters": {...}}` (transformers' spec language has no "the whole text is JSON", so this
  one is read with `json.loads`).

A leading `<think>...</think>` is the reasoning in every family (training writes reasoning so for templates
without a reasoning field, and Qwen3's and the R1 distills' render it so); a generation prompt that already
opened `<think>` (the R1 distills') counts as the reply's start. Each call goes through the training
normaliser (`finetune.data.chat.normalize_tool_call`), so it is the shape training reads. Whatever does not
parse (bad JSON, a call without a name) stays the reply's text, as the server returned it before.

Example:
    parser = ReplyParser.for_tokenizer(tokenizer)
    parser.parse('<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>', prompt_text)
    # Reply(content=None, reasoning=None, tool_calls=({"id": "call_...", "type": "function",
    #       "function": {"name": "f", "arguments": '{"x": 1}'}},))
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from finetune.data.chat import listed, normalize_tool_call
from finetune.errors import DataError

_THINK = {"reasoning_content": {"open": "<think>", "close": "</think>"}}
_START = {"start_anchor_pattern": "^"}  # the parser is given the reply alone (prefix ""): it starts there
HERMES = {
    **_START,
    "fields": {
        **_THINK,
        "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json", "repeats": True},
        "content": {},
    },
}
MISTRAL = {**_START, "fields": {**_THINK, "tool_calls": {"open": "[TOOL_CALLS]", "content": "json"}, "content": {}}}
REASONING_ONLY = {**_START, "fields": {**_THINK, "content": {}}}  # fmt: skip
_OPENED_THINK = re.compile(r"<think>\s*$")
_PYTHON_TAG = "<|python_tag|>"
_ALPHANUMERIC = string.ascii_letters + string.digits


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Mistral's template raises on any tool call id but 9 letters and digits."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


@dataclass(frozen=True)
class Reply:
    """An assistant message as OpenAI returns it; `content` None only when it calls tools."""

    content: str | None
    reasoning: str | None = None
    tool_calls: tuple[dict[str, Any], ...] = field(default=())

    def message(self) -> dict[str, Any]:
        """The response's `message` (also a stream's final delta, less the role)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = list(self.tool_calls)
        return out


@dataclass(frozen=True)
class ReplyParser:
    """How replies of one tokenizer are read: a transformers response spec, and whether a whole reply may be a
    Llama-style JSON call."""

    spec: dict[str, Any]
    json_call: bool = False
    new_id: Callable[[], str] = openai_call_id
    """The id of a call the model wrote without one."""

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> ReplyParser:
        own = getattr(tokenizer, "response_template", None)
        if isinstance(own, dict):
            return cls(own)
        try:
            template = tokenizer.get_chat_template()
        except (ValueError, TypeError):
            template = ""
        if "<tool_call>" in template:
            return cls(HERMES)
        if "[TOOL_CALLS]" in template:
            return cls(MISTRAL, new_id=mistral_call_id)
        if "<|start_header_id|>" in template and '"parameters"' in template:
            return cls(REASONING_ONLY, json_call=True)
        return cls(REASONING_ONLY)

    def parse(self, text: str, prompt_text: str = "", tools: bool = True) -> Reply | None:
        """`text` (the reply, special tokens kept) as a message, or None where it holds no tool call nor
        reasoning that parses (the reply is then its text, as decoded for `content`); `prompt_text` tells
        whether the generation prompt opened `<think>`. With `tools` False only reasoning is read. A call that
        does not parse stays the reply's text, but the reasoning before it is still read: it leaked into
        `content` only because a call after it was malformed (or in another family's format)."""
        opened = "<think>" if _OPENED_THINK.search(prompt_text) and "</think>" in text else ""
        read = _read(opened + text, self.spec, self.json_call, self.new_id) if tools else None
        return read or _read(opened + text, REASONING_ONLY, False, self.new_id)


def _read(text: str, spec: dict[str, Any], json_call: bool, new_id: Callable[[], str]) -> Reply | None:
    """`text` read with `spec` (and, where `json_call`, as one Llama-style JSON call); None where it does not
    parse, or holds neither a call nor reasoning."""
    from transformers.utils.chat_parsing import parse_response

    try:
        parsed = parse_response(text, spec, prefix="")
    except (ValueError, KeyError, TypeError):
        return None
    calls = parsed.get("tool_calls") or []
    content, reasoning = parsed.get("content"), parsed.get("reasoning_content")
    if json_call and not calls and content:
        calls, content = _json_call(content)
    try:
        made = tuple(_openai_call(call, index, new_id) for index, call in enumerate(listed(calls)))
    except DataError:
        return None
    if not made and reasoning is None:
        return None
    return Reply(content or (None if made else ""), reasoning, made)


def _json_call(content: str) -> tuple[list[Any], str | None]:
    """A Llama 3.1 reply that is one JSON call, as (calls, no content); else (no calls, the content)."""
    try:
        call = json.loads(content.removeprefix(_PYTHON_TAG))
    except ValueError:
        return [], content
    if isinstance(call, dict) and isinstance(call.get("name"), str) and ("parameters" in call or "arguments" in call):
        return [call], None
    return [], content


def _openai_call(call: Any, index: int, new_id: Callable[[], str]) -> dict[str, Any]:
    """One parsed call as OpenAI returns it: an id (the model's own where it wrote one), arguments as JSON text."""
    normal = normalize_tool_call(call, f"tool call {index}")
    arguments = json.dumps(normal["function"]["arguments"], ensure_ascii=False)
    call_id = normal.get("id") or new_id()
    return {"id": call_id, "type": "function", "function": {"name": normal["function"]["name"], "arguments": arguments}}
