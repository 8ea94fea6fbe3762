"""The OpenAI wire format of `finetune serve`: request bodies (validated strictly) and response JSON.

Requests are pydantic models with `extra="forbid"` and strict types: a parameter this server does not
implement is a 400 naming it, rather than silently ignored, and `"max_tokens": true` is not taken for 1. Parameters clients commonly send with neutral values
(`n: 1`, `presence_penalty: 0`, `logprobs: null`, `user`) are accepted. `return_token_ids` (as in vLLM)
adds `prompt_token_ids` and `token_ids` to each choice. Errors have OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`.

Example:
    request = parse_body(CompletionRequest, b'{"model": "legal", "prompt": "hi", "max_tokens": 8}')
    completion_body("cmpl-1", "legal", created, [finished], usage_of([finished]))
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from finetune.errors import ServeError
from finetune.serve.batcher import Finished
from finetune.serve.replies import Reply
from finetune.strict_json import is_text

MAX_STOP_SEQUENCES = 16
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Generation(_Strict):
    """Parameters shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM's extension; 0 or -1: off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    n: Literal[1] = 1
    presence_penalty: Literal[0] = 0
    frequency_penalty: Literal[0] = 0
    logprobs: Literal[False] | None = None
    logit_bias: dict[str, float] | None = Field(None, max_length=0)
    user: str | None = None

    @field_validator("n", "logprobs", "presence_penalty", "frequency_penalty", mode="before")
    @classmethod
    def _neutral_only(cls, value: Any, info: Any) -> Any:
        """These are accepted only with the neutral value a client sends by default. A Literal also matches an
        equal value of another type: `logprobs: 0` (on /v1/completions: the chosen tokens' log-probabilities)
        passed as False and was answered without them, `n: true` passed as 1."""
        name = info.field_name
        if name == "logprobs":
            neutral, shown = value is None or value is False, "false or null"
        else:
            number = type(value) in (int, float) if name.endswith("penalty") else type(value) is int
            neutral, shown = number and value == (1 if name == "n" else 0), "1" if name == "n" else "0"
        if not neutral:
            raise ValueError(f"this server supports only {shown}")
        return value

    @model_validator(mode="after")
    def _stream_options_only_when_streaming(self) -> _Generation:
        if self.stream_options is not None and not self.stream:  # OpenAI refuses it too
            raise ServeError("stream_options: only allowed with stream: true", param="stream_options")
        return self

    def stop_sequences(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
            raise ServeError(f"stop: give at most {MAX_STOP_SEQUENCES} non-empty strings", param="stop")
        return tuple(stops)


class CompletionRequest(_Generation):
    """POST /v1/completions. A list of prompts gives one choice each (all batched together)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    """Text, texts, token ids, or lists of token ids (as OpenAI's API and vLLM take them)."""
    max_tokens: int | None = Field(COMPLETION_DEFAULT_MAX_TOKENS, ge=1)
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per choice: a text, or token ids taken as they are (no BOS added)."""
        prompt = self.prompt
        one = isinstance(prompt, str) or (bool(prompt) and all(isinstance(token, int) for token in prompt))
        prompts: list[Any] = [prompt] if one else list(prompt)
        if not prompts or any(isinstance(p, list) and not p for p in prompts):
            raise ServeError(f"prompt: {PROMPT_FORMS}, none of them empty", param="prompt")
        return prompts


PROMPT_FORMS = "give a string, a list of strings, token ids (a list of integers), or a list of such lists"


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str = Field(min_length=1)
    arguments: str
    """JSON text, as OpenAI sends it (checked when the conversation is normalised: not JSON is a 400)."""


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionSchema(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSchema


_ABSENT: Any = object()  # `content` not given (null is given)


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(_ABSENT, validate_default=True)
    """Null or absent only on an assistant turn that calls tools (checked with the training rules)."""
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: list[Any] | None = None

    @field_validator("refusal", "audio", "function_call", "annotations", mode="before")
    @classmethod
    def _echoed_nulls(cls, value: Any, info: Any) -> Any:
        """Fields of OpenAI's assistant message that a client echoes back as the server returned it (the
        openai client's `message.model_dump()` has `refusal`, `audio`, `function_call` and `annotations`, all
        null here): accepted when null (annotations: also empty), a 400 otherwise, since none is rendered."""
        if value is None or (info.field_name == "annotations" and value == []):
            return None
        raise ValueError("this server supports only null" + (" or []" if info.field_name == "annotations" else ""))

    @field_validator("content", mode="before")
    @classmethod
    def _content_unless_calling(cls, value: Any, info: Any) -> Any:
        """Required but on an assistant turn (whose tool calls may say all): a message of another role
        without content says nothing, and was rendered as an empty turn."""
        if info.data.get("role") == "assistant":
            return None if value is _ABSENT else value
        if value is _ABSENT:
            raise PydanticCustomError("missing", "Field required")
        if value is None:
            raise ValueError(UNION_FORMS["content"])
        return value

    def as_record_message(self) -> dict[str, Any]:
        """The message in the OpenAI shape `finetune.data.chat.normalize_messages` reads (as training does)."""
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        message = self.model_dump(exclude_none=True, exclude={"content"})
        return {**message, "content": content}


class ChatCompletionRequest(_Generation):
    """POST /v1/chat/completions: the conversation (with its tools) is rendered as training renders it."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    """`none`: the reply is not read for tool calls (the tools are still in the prompt, as at training)."""
    parallel_tool_calls: bool | None = None

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def record_tools(self) -> list[dict[str, Any]] | None:
        """The tools as a training record's `tools` column (None without any)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None


class LoadAdapterRequest(_Strict):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str
    lora_path: str


class UnloadAdapterRequest(_Strict):
    """POST /v1/unload_lora_adapter (vLLM's body; `lora_int_id` is accepted and ignored)."""

    lora_name: str
    lora_int_id: int | None = None


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """The request body as `model`; ServeError (400) for bad JSON or the first invalid field."""
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise ServeError(f"the request body is not valid JSON ({exc})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ServeError("the request body must be a JSON object", code="invalid_json")
    if not is_text(data):  # "\ud800" is valid JSON but no text: the tokenizer raised TypeError on it (a 500)
        raise ServeError(
            "the request body has a string with a lone surrogate escape (such as \\ud800), which is not text",
            code="invalid_json",
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        more = exc.error_count() - 1
        if first["type"] == "extra_forbidden":
            message = f"{param}: this server does not support this parameter"
        elif first["loc"][0] == "prompt":  # one error per form of the union: say the forms instead
            param, message, more = "prompt", f"prompt: {PROMPT_FORMS}", 0
        elif (union := _union_field(first["loc"])) is not None:  # likewise, where pydantic names a form in the path
            param, message, more = union[0], f"{union[0]}: {union[1]}", 0
        else:
            said = first["msg"].removeprefix("Value error, ")  # a validator's own message, as it wrote it
            message = f"{param}: {said}" if param else said
        raise ServeError(message + (f" (and {more} more problems)" if more else ""), param=param) from None


UNION_FORMS = {
    "stop": "give a string or a list of strings",
    "content": 'give a string or a list of {"type": "text", "text": ...} parts',
}
"""What a field of several forms takes, said instead of pydantic's error for its first form."""


def _union_field(loc: tuple) -> tuple[str, str] | None:
    """(the field's path, its forms) where `loc` runs into a form of a field of `UNION_FORMS` (pydantic names the
    form it tried after the field: `messages.0.content.str`, `stop.list[str].1`), else None."""
    for at, part in enumerate(loc[:-1]):
        if part in UNION_FORMS and isinstance(loc[at + 1], str):
            return ".".join(str(p) for p in loc[: at + 1]), UNION_FORMS[part]
    return None


def error_body(error: ServeError) -> dict:
    return {"error": {"message": str(error), "type": error.error_type, "param": error.param, "code": error.code}}


def usage_of(results: list[Finished]) -> dict:
    prompt = sum(len(r.prompt_token_ids) for r in results)
    completion = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _token_ids(result: Finished, wanted: bool) -> dict:
    return {"prompt_token_ids": result.prompt_token_ids, "token_ids": result.token_ids} if wanted else {}


def completion_body(request_id: str, model: str, created: int, results: list[Finished], token_ids: bool) -> dict:
    choices = [
        {
            "index": r.index,
            "text": r.text,
            "logprobs": None,
            "finish_reason": r.finish_reason,
            **_token_ids(r, token_ids),
        }
        for r in results
    ]
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_of(results),
    }


def chat_body(
    request_id: str, model: str, created: int, result: Finished, token_ids: bool, reply: Reply | None = None
) -> dict:
    """The chat completion; `reply` is the text read as tool calls and reasoning (None: the text as content)."""
    choice = {
        "index": 0,
        "message": reply.message() if reply is not None else {"role": "assistant", "content": result.text},
        "logprobs": None,
        "finish_reason": chat_finish_reason(result, reply),
        **_token_ids(result, token_ids),
    }
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_of([result]),
    }


def chat_finish_reason(result: Finished, reply: Reply | None) -> str:
    """`tool_calls` where the reply calls tools (as OpenAI says it), else why generation stopped."""
    return "tool_calls" if reply is not None and reply.tool_calls else result.finish_reason


def final_chat_delta(reply: Reply | None) -> dict:
    """The last chunk's delta of a stream: its tool calls, indexed as OpenAI streams them (the text itself was
    streamed as content, as generated), and its reasoning."""
    if reply is None:
        return {}
    delta: dict[str, Any] = {}
    if reply.reasoning is not None:
        delta["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(reply.tool_calls)]
    return delta


def completion_chunk(request_id: str, model: str, created: int, index: int, text: str, finish: str | None) -> dict:
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_chunk(request_id: str, model: str, created: int, delta: dict, finish: str | None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def usage_chunk(request_id: str, model: str, created: int, obj: str, results: list[Finished]) -> dict:
    """The last chunk when `stream_options.include_usage`: no choices, the usage."""
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_of(results),
    }


def models_body(cards, created: int, max_model_len: int) -> dict:
    data = [
        {
            "id": card.id,
            "object": "model",
            "created": created,
            "owned_by": "finetune",
            "root": card.root,
            "parent": card.parent,
            "max_model_len": max_model_len,
        }
        for card in cards
    ]
    return {"object": "list", "data": data}
