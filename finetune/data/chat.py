"""Chat records as people have them → one normalised message list, checked, and handed to a template.

Accepted shapes, per record:
- OpenAI / Hugging Face `messages`: `{role, content}` with `content: null` allowed on an assistant turn
  that only calls tools; `tool_calls: [{id, type, function: {name, arguments}}]` (arguments as JSON text or
  an object; a bare `{name, arguments}` is accepted too); `tool` (or Llama's `ipython`) results with
  optional `name` / `tool_call_id`; reasoning as `reasoning_content`, `reasoning`, `thinking`, or inline
  as a leading `<think>...</think>` in the content.
- ShareGPT `conversations`: `{from, value}` with human/gpt/system, `function_call` (the value is the call
  as JSON: `{"name", "arguments"}`, or a list of them) and `observation` (a tool result).
- A `tools` column (a list of function schemas, or that list as JSON text): rendered by the template into
  the prompt and used to check the calls.

Normalised, a message is `{role, content, reasoning?, tool_calls?, name?, tool_call_id?}` with `content` a
string (empty where there was none) and tool-call arguments as objects. `for_template` turns that into
what a given template reads: reasoning under `reasoning_content` (Qwen3), `thinking` (gpt-oss) or inline
`<think>` (templates that read neither, such as the DeepSeek-R1 distills'), `developer` as `system` where the
template has no developer role, `content: null` where the
template tests for it (DeepSeek's tool-call branch), arguments as JSON text where the template
concatenates them.

Example:
    chat = normalize_record(record, "messages", "a.jsonl line 3 (record 3)")
    chat.messages[1]["tool_calls"][0]["function"]["arguments"]   # {"city": "Paris"}
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from finetune.errors import DataError

_SHAREGPT_FIELD = "conversations"
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
    "function_call": "assistant",
    "observation": "tool",
}
_ROLES = ("system", "developer", "user", "assistant", "tool")
_ROLE_ALIASES = {"ipython": "tool", "function": "tool"}
_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
_INLINE_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


@dataclass(frozen=True)
class ChatRecord:
    """A conversation, normalised: its messages and the tools its template is given (None: no tools)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


def normalize_record(record: dict[str, Any], messages_field: str, where: str, tools_field: str = "tools") -> ChatRecord:
    """The record's conversation (OpenAI `messages_field`, else ShareGPT `conversations`), normalised and
    checked: tool results follow a call, calls name a tool in `tools` when it is given, arguments are JSON.

    Raises:
        DataError: one line naming the record (`where`), the message and how to fix it.
    """
    tools = normalize_tools(record.get(tools_field), where, tools_field)
    raw = record.get(messages_field)
    if raw is None and _SHAREGPT_FIELD in record:
        return ChatRecord(_from_sharegpt(record[_SHAREGPT_FIELD], where, tools), tools)
    if raw is None and messages_field in record:
        raise DataError(
            f"{where}: field {messages_field!r} is null; give the conversation's messages, or fix the record"
        )
    if raw is None:
        have = ", ".join(repr(key) for key in record) or "none"
        raise DataError(
            f"{where}: no field {messages_field!r} (fields it has: {have}); set data.messages_field to the "
            "field that holds the messages, or fix the record"
        )
    return ChatRecord(normalize_messages(raw, where, tools, messages_field), tools)


def normalize_messages(
    messages: Any,
    where: str,
    tools: list[dict[str, Any]] | None = None,
    name: str = "messages",
    *,
    context_only: bool = False,
) -> list[dict[str, Any]]:
    """A list of OpenAI-shape messages, normalised (see the module docstring) and checked.

    Used for a chat record's messages and for the prompt and completions of preference and prompt records,
    so every path reads the same shapes. `name` is the field named in errors. `context_only`: no turn of these
    messages is trained (`finetune serve`'s request history), so an assistant turn may have an empty or blank
    text, as OpenAI's API takes one: a reply of no text (an immediate end of turn) sent back with the next
    question was a 400. Training refuses it, since the turn's end token alone would be trained.
    """
    if not isinstance(messages, list) or not messages:
        kind = "an empty list" if isinstance(messages, list) else f"{type(messages).__name__} {_preview(messages)}"
        fix = "fix the record" if name in ("prompt", "completion") else "fix the record or set data.messages_field"
        raise DataError(
            f"{where}: field {name!r} must be a non-empty list of {{role, content}} messages, got {kind}; {fix}"
        )
    normalized = [_message(m, f"{where}: {name}[{index}]", context_only) for index, m in enumerate(messages)]
    check_tool_use(normalized, tools, where, name)
    return normalized


def _message(message: Any, at: str, context_only: bool = False) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise DataError(
            f"{at} must be an object with 'role' and 'content', got {type(message).__name__} {_preview(message)}; "
            "fix the record"
        )
    role = message.get("role")
    role = _ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
    if role not in _ROLES:
        raise DataError(f"{at}.role must be one of {', '.join(_ROLES)} (or ipython), got {role!r}; fix the record")
    content = message.get("content")
    if content is None and role != "assistant" and role != "tool":
        raise DataError(
            f"{at}.content must be a string, got {'missing' if 'content' not in message else 'None'}; fix the record"
        )
    if role == "tool" and not isinstance(content, str):
        content = "" if content is None else json.dumps(content, ensure_ascii=False)  # a structured result
    if content is not None and not isinstance(content, str):
        raise DataError(
            f"{at}.content must be a string (or null on an assistant turn that calls tools), got "
            f"{type(content).__name__} {_preview(content)}; fix the record"
        )
    out: dict[str, Any] = {"role": role, "content": content or ""}
    if role == "assistant":
        reasoning = next((message[key] for key in _REASONING_KEYS if message.get(key)), None)
        if reasoning is not None and not isinstance(reasoning, str):
            raise DataError(f"{at}: reasoning must be a string, got {type(reasoning).__name__}; fix the record")
        inline = _INLINE_THINK.match(out["content"])
        if inline:  # `<think>...</think>answer`: the reasoning, kept apart so each template gets it its way
            reasoning = reasoning or inline.group(1).strip("\n")
            out["content"] = out["content"][inline.end() :]
        if reasoning:
            out["reasoning"] = reasoning
        calls = message.get("tool_calls")
        if calls is None and isinstance(message.get("function_call"), dict):
            calls = [message["function_call"]]  # OpenAI's older single-call field
        if calls:
            out["tool_calls"] = [
                normalize_tool_call(call, f"{at}.tool_calls[{i}]") for i, call in enumerate(listed(calls))
            ]
        elif content is None or not (context_only or out["content"].strip() or reasoning):  # else its end token
            # alone would be trained
            state = "missing" if "content" not in message else "None" if content is None else "empty"
            raise DataError(
                f"{at}.content is {state} on an assistant turn that calls no tools; give the reply's text (null or "
                "empty only with tool_calls), or fix the record"
            )
    for key in ("name", "tool_call_id"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def listed(calls: Any) -> list[Any]:
    """Tool calls as a list: one call given alone is a list of one."""
    return calls if isinstance(calls, list) else [calls]


def normalize_tool_call(call: Any, at: str) -> dict[str, Any]:
    """`{id?, type: function, function: {name, arguments: object}}` from the OpenAI or bare `{name, arguments}`."""
    if not isinstance(call, dict):
        raise DataError(f"{at} must be an object with function.name and function.arguments; fix the record")
    function = call.get("function", call)
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise DataError(f"{at}: the call has no function name (function.name); fix the record")
    arguments = function.get("arguments", function.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{at}: the arguments of {name!r} are not valid JSON ({exc.msg} at character {exc.pos}: "
                f"{_preview(arguments)}); give a JSON object"
            ) from None
    if not isinstance(arguments, dict):
        raise DataError(
            f"{at}: the arguments of {name!r} must be a JSON object, got {type(arguments).__name__} "
            f"{_preview(arguments)}; fix the record"
        )
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def check_tool_use(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, where: str, name: str) -> None:
    """Every tool result answers a call made before it (by `tool_call_id` when both carry ids), and every
    call names a tool in `tools` when the record gives them."""
    known = {tool["function"]["name"] for tool in tools} if tools else None
    pending: list[dict[str, Any]] = []  # calls of the latest assistant turn not yet answered
    for index, message in enumerate(messages):
        at = f"{where}: {name}[{index}]"
        if message["role"] == "assistant":
            pending = list(message.get("tool_calls", []))
            for call in pending:
                called = call["function"]["name"]
                if known is not None and called not in known:
                    raise DataError(
                        f"{at} calls {called!r}, which is not in the record's tools ({', '.join(sorted(known))}); "
                        "add its schema to tools or fix the call"
                    )
        elif message["role"] == "tool":
            if not pending:
                raise DataError(
                    f"{at} is a tool result with no tool call before it (the assistant turn before it calls "
                    "no tool, or its calls are already answered); add the call or remove the result"
                )
            ids = [call.get("id") for call in pending]
            wanted = message.get("tool_call_id")
            if wanted is not None and wanted in ids:
                pending.pop(ids.index(wanted))
            elif wanted is not None and any(ids):
                raise DataError(
                    f"{at} answers tool_call_id {wanted!r}, but the calls before it have ids "
                    f"{', '.join(repr(i) for i in ids if i)}; fix the id"
                )
            else:
                pending.pop(0)
        elif message["role"] == "user":
            pending = []


def normalize_tools(tools: Any, where: str, field: str = "tools") -> list[dict[str, Any]] | None:
    """The record's tools as `[{type: function, function: {name, description?, parameters?}}]` (also
    accepted: bare function schemas, and the list as JSON text as ShareGPT datasets store it)."""
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: field {field!r} is not valid JSON ({exc.msg}); give a list of schemas") from None
    if not isinstance(tools, list):
        raise DataError(f"{where}: field {field!r} must be a list of function schemas, got {type(tools).__name__}")
    out = []
    for index, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise DataError(f"{where}: {field}[{index}] must be a function schema with a 'name'; fix the record")
        out.append({"type": "function", "function": function})
    return out


def _from_sharegpt(turns: Any, where: str, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """ShareGPT turns as OpenAI messages: `function_call` → an assistant turn with tool_calls,
    `observation` → a tool result."""
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise DataError(f"{where}: field 'conversations' must be a list of {{from, value}} objects; fix the record")
    messages: list[dict[str, Any]] = []
    for index, turn in enumerate(turns):
        speaker, value = turn.get("from"), turn.get("value")
        if speaker not in _SHAREGPT_ROLES or not isinstance(value, str):
            raise DataError(
                f"{where}: conversations[{index}] needs 'from' (one of {', '.join(_SHAREGPT_ROLES)}) "
                f"and a string 'value', got from={speaker!r}; fix the record"
            )
        if speaker == "function_call":
            try:
                calls = json.loads(value)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{where}: conversations[{index}] (function_call) is not valid JSON ({exc.msg}); its value must "
                    'be {"name": ..., "arguments": {...}}'
                ) from None
            messages.append({"role": "assistant", "content": None, "tool_calls": listed(calls)})
        else:
            messages.append({"role": _SHAREGPT_ROLES[speaker], "content": value})
    return normalize_messages(messages, where, tools, "conversations")


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class TemplateReads:
    """How one template reads the parts of a message that templates disagree on."""

    reasoning_key: str | None
    """`reasoning_content`, `thinking`, or None: reasoning goes inline as `<think>` before the content."""
    null_content: bool
    """The template tests `content is none` (a tool-call turn without text): rendered through
    `null_content_as_empty`."""
    arguments_as_text: bool
    """The template concatenates the arguments as text instead of `| tojson`-ing an object."""
    one_analysis: bool = False
    """A tool-call turn takes its text or its reasoning as one analysis message, not both (gpt-oss):
    given both, they are joined into the reasoning."""
    calls_without_text: bool = False
    """The template renders a turn's tool calls only when it has no text (the R1 distills'): reasoning, which it
    would take inline as text, is left out of such a turn."""
    developer_role: bool = True
    """The template knows OpenAI's `developer` role (gpt-oss's); one that never names it renders no such message
    (Qwen's, DeepSeek's, GLM's drop it without a word), so it is given as the system message it stands for."""


def template_reads(template: str) -> TemplateReads:
    """What `template` reads, from its source: the names of fields are the template's interface."""
    if "reasoning_content" in template:
        key: str | None = "reasoning_content"
    elif re.search(r"message\.thinking|message\[['\"]thinking['\"]\]|\"thinking\" in message", template):
        key = "thinking"
    else:
        key = None
    null_content = bool(re.search(r"content['\"]?\]?\s+is\s+none", template))
    as_text = bool(re.search(r"\+\s*\w+\[['\"]function['\"]\]\[['\"]arguments['\"]\]", template))
    one_analysis = "Cannot pass both content and thinking" in template
    with_text = re.search(r"content['\"]?\]?\s+is\s+not\s+none", template)
    calls_without_text = with_text is not None and "tool_calls" not in template[with_text.end() :]
    return TemplateReads(key, null_content, as_text, one_analysis, calls_without_text, "developer" in template)


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with OpenAI's `developer` role given as `system`, for a template that has no developer role
    (`for_template`, through which training and `serve` both render)."""
    return [{**message, "role": "system"} if message.get("role") == "developer" else message for message in messages]


def for_template(messages: list[dict[str, Any]], reads: TemplateReads, reasoning: bool = True) -> list[dict[str, Any]]:
    """Normalised messages in the form a template reads (see `template_reads`); without reasoning when
    `reasoning` is False."""
    out = []
    for message in messages if reads.developer_role else _developer_as_system(messages):
        if message["role"] != "assistant":
            out.append(message)
            continue
        shown = {key: value for key, value in message.items() if key != "reasoning"}
        thought = message.get("reasoning") if reasoning else None
        if thought and reads.calls_without_text and not reads.reasoning_key and message.get("tool_calls"):
            thought = None  # inline, it would be the turn's text, and the template would drop the calls for it
        if thought and reads.one_analysis and message.get("tool_calls") and message["content"]:
            thought, shown["content"] = f"{thought}\n\n{message['content']}", ""
        if thought and reads.reasoning_key:
            shown[reads.reasoning_key] = thought
        elif thought:
            shown["content"] = f"<think>\n{thought}\n</think>\n\n{message['content']}"
        if "tool_calls" in shown:
            if reads.arguments_as_text:
                shown["tool_calls"] = [_as_text(call) for call in shown["tool_calls"]]
        out.append(shown)
    return out


_NULL_TEST = re.compile(r"""(message\[['"]content['"]\]|message\.content)\s+is\s+(not\s+)?none""")


def null_content_as_empty(template: str) -> str:
    """`template` with its `content is none` tests true of an empty content too.

    A tool-call turn without text is `content: null`, and such templates (DeepSeek's) render the calls only in
    their `is none` branch; but transformers drops the keys whose value is None before rendering, so the
    template would read a missing key. The turn is given `""` instead and the test reads it as null; a template
    gives an empty text nothing else to render. Only where the turn calls tools: an empty turn without calls (in
    `finetune serve`'s request history) read as null went down the call branch, which rendered nothing of it,
    and the conversation showed two user turns in a row."""

    def either(match: re.Match) -> str:
        value, negated = match.group(1), match.group(2)
        calls = "(message.tool_calls is defined and message.tool_calls)"  # an empty turn without calls stays a turn
        if negated:
            return f"({value} is not none and ({value} != '' or not {calls}))"
        return f"({value} is none or ({value} == '' and {calls}))"

    return _NULL_TEST.sub(either, template)


def _as_text(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {**call, "function": {**function, "arguments": json.dumps(function["arguments"], ensure_ascii=False)}}
