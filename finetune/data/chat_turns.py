"""Render a conversation with its chat template and find, in that rendering, what each assistant turn trains.

What the model writes in an assistant turn is everything after the generation prompt (the assistant's
header, `<|im_start|>assistant\\n`, `<|start|>assistant`, `[/INST]`) through the turn's closing token
(`<|im_end|>`, `<|eot_id|>`/`<|eom_id|>`, `<|call|>`/`<|return|>`, `</s>`, ...): its reasoning as the
template renders it, its answer, its tool calls with the template's own wrapping (`<tool_call>`, a channel
header, `[TOOL_CALLS]`). That span is found in the real rendering of the whole conversation, so templates
whose text depends on the assistant's words (Llama 3.1's tool calls, gpt-oss's channels, Qwen3 dropping
earlier turns' reasoning) are handled and nothing is refused:

1. the assistant's words: the conversation is rendered once more with this turn's words (content,
   reasoning, call arguments; never the tool names, which other messages refer to) replaced by sentinels.
   The two renderings differ only in that turn, so the first and last differing characters bound it;
2. its start: back to the end of the generation prompt before those words (the last occurrence of the
   template's header between the previous turn and the words); where there is none (Mistral's turns after
   a tool result), where the conversation before the turn, rendered as a prompt, ends;
3. its end: forward to the first closing token after the words (and any closing tokens right after it),
   provided no other message comes first.

Templates with `{% generation %}` marks use them instead (`return_assistant_tokens_mask`).

Example:
    ids, trained = render_chat(normalize_record(record, "messages", where), template, tokenizer, where)
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache, wraps
from typing import Any, Literal, NamedTuple, TypeVar

from finetune.data.chat import ChatRecord, for_template, null_content_as_empty, template_reads
from finetune.errors import DataError

Reasoning = Literal["template", "every_turn", "none"]

_SENTINEL = "\u2063ft-words\u2063"  # invisible separators: never in real data, untouched by `| trim`
_KNOWN_CLOSERS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|call|>", "<|return|>", "<end_of_turn>", "</s>",
    "<|endoftext|>", "<｜end▁of▁sentence｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "<|END_OF_TURN_TOKEN|>",
)  # fmt: skip


_Result = TypeVar("_Result")


def _tokenizer_state(tokenizer: Any) -> tuple[Any, ...]:
    """What of a tokenizer the probes below read that a caller can change in place: its size (added tokens) and
    its special tokens (`add_special_tokens({"eos_token": ...})` keeps the object and changes both)."""
    return len(tokenizer), repr(sorted(tokenizer.special_tokens_map.items())), tuple(tokenizer.all_special_tokens)


def _per_tokenizer_state(maxsize: int) -> Callable[[Callable[..., _Result]], Callable[..., _Result]]:
    """`lru_cache` for a probe of `(tokenizer, ...)`, keyed by the tokenizer's `_tokenizer_state` too.

    Keyed by the tokenizer object alone, a tokenizer changed in place between two builds in one process (a
    notebook adding a special token as EOS) was probed as it had been: the new EOS went untrained, and the rows,
    whose data fingerprint does see the change, were cached under it for every later run to load.
    """

    def decorate(probe: Callable[..., _Result]) -> Callable[..., _Result]:
        @lru_cache(maxsize=maxsize)
        def cached(tokenizer: Any, state: tuple[Any, ...], *args: Any) -> _Result:
            return probe(tokenizer, *args)

        @wraps(probe)
        def call(tokenizer: Any, *args: Any) -> _Result:
            return cached(tokenizer, _tokenizer_state(tokenizer), *args)

        return call

    return decorate


def has_generation_marks(template: str) -> bool:
    """Whether the template marks assistant output with `{% generation %}` (then its marks are used)."""
    return re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


def template_kwargs(reasoning: Reasoning) -> dict[str, Any]:
    """Extra template variables: `enable_thinking=False` when training without reasoning (Qwen3 then renders
    the empty `<think></think>` it renders at inference with thinking off)."""
    return {"enable_thinking": False} if reasoning == "none" else {}


def apply_template(
    tokenizer: Any, chat: ChatRecord, template: str, where: str, reasoning: Reasoning = "template", **kwargs: Any
) -> Any:
    """`tokenizer.apply_chat_template` on the normalised conversation in the form `template` reads, with its
    tools. A template that refuses a leading system message (Gemma 2, Mistral's) gets it folded into the
    first user turn, as Gemma 3's own template does."""
    check_renders_tools(chat, template, where)
    chat, _ = with_system_shown(chat, template, tokenizer)
    reads = template_reads(template)
    messages = for_template(chat.messages, reads, reasoning != "none")
    template = null_content_as_empty(template) if reads.null_content else template
    return _apply(tokenizer, messages, chat.tools, template, where, {**template_kwargs(reasoning), **kwargs})


def _turn_closers(tokenizer: Any, template: str) -> list[str]:
    """The closing markers right after an assistant turn's words in `template`'s rendering of a one-question
    conversation (known closers and the tokenizer's EOS, in order); [] where there are none or the template
    refuses the probe (its records are then checked as they are rendered)."""
    text = _probe(
        tokenizer, template, [{"role": "user", "content": "ft-probe"}, {"role": "assistant", "content": _SENTINEL}]
    )
    if text is None:
        return []
    rest = text[text.find(_SENTINEL) + len(_SENTINEL) :].lstrip()
    candidates = sorted({*_KNOWN_CLOSERS, tokenizer.eos_token or ""} - {""}, key=len, reverse=True)
    chain = []
    while (closer := next((c for c in candidates if rest.startswith(c)), None)) is not None:
        chain.append(closer)
        rest = rest[len(closer) :]
    return chain


def _probe(tokenizer: Any, template: str, messages: list[dict[str, Any]]) -> str | None:
    """`template`'s text of a probe conversation, or None where the template refuses it (what it reads of real
    records is then checked as they are rendered)."""
    try:
        return _apply(tokenizer, messages, None, template, "the chat template", {"tokenize": False})
    except DataError:
        return None


def _token_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@_per_tokenizer_state(maxsize=64)
def check_turn_closer(tokenizer: Any, template: str) -> None:
    """Refuse a template whose assistant turn closes with a marker this tokenizer has no token for (ChatML's
    `<|im_end|>` given as `data.chat_template` to a Llama or Mistral base), where no token such as EOS follows
    it: the marker would be trained as several ordinary tokens, and generation, which stops on a token (EOS,
    the generation config's, `turn_closer_ids`), would never stop.

    Raises:
        DataError: the turn ends with no single token; the message says how to fix the template.
    """
    chain = _turn_closers(tokenizer, template)
    if chain and not turn_closer_ids(tokenizer, template):
        pieces = len(_token_ids(tokenizer, chain[0]))
        raise DataError(
            f"the chat template closes an assistant turn with {chain[0]!r}, which this tokenizer has no token for "
            f"(it reads it as {pieces} ordinary tokens), so the tuned model could never stop on it; close the turn "
            f"with the tokenizer's EOS in data.chat_template ({{{{ eos_token }}}}, here {tokenizer.eos_token!r}), "
            "or use a base whose tokenizer has the template's special tokens"
        )


@_per_tokenizer_state(maxsize=64)
def turn_closer_ids(tokenizer: Any, template: str) -> frozenset[int]:
    """The single tokens that close an assistant turn of `template` (`<|im_end|>`, `<|eot_id|>`, `<|return|>`):
    where a chat reply ends. A base fine-tuned for chat with its tokenizer's template (a Llama 3.1 or Qwen2.5
    base) lists none of them as EOS, in the tokenizer or the generation config, so chat generation stopped only
    at the token limit; `generate --chat` and `serve`'s chat replies stop at them too."""
    pieces = (_token_ids(tokenizer, closer) for closer in _turn_closers(tokenizer, template))
    return frozenset(ids[0] for ids in pieces if len(ids) == 1)


def chat_turn_closer_ids(tokenizer: Any, template: str | None = None) -> frozenset[int]:
    """`turn_closer_ids` of `template`, else of the tokenizer's own chat template; none where there is neither
    (`serve`'s chat replies and GRPO's completions stop at them)."""
    if template is None:
        try:
            template = tokenizer.get_chat_template()
        except ValueError:
            return frozenset()
    return turn_closer_ids(tokenizer, template)


def check_renders_tools(chat: ChatRecord, template: str, where: str) -> None:
    """A record with tool calls or results needs a template that renders them: one that never mentions tools
    (Phi-3.5's and Phi-4's, Gemma's) would drop those turns without a word, and train what is left."""
    uses_tools = any(m["role"] == "tool" or m.get("tool_calls") for m in chat.messages)
    if uses_tools and "tool" not in template:
        raise DataError(
            f"{where}: the record has tool calls or tool results, and the chat template renders neither (it never "
            "mentions tools); give data.chat_template a template that renders them, or leave the tool turns out"
        )


def _apply(tokenizer, messages, tools, template: str, where: str, kwargs: dict[str, Any]):
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, **kwargs)
    except TemplateError as exc:
        if len(messages) > 1 and messages[0]["role"] == "system" and messages[1]["role"] == "user":
            return _apply(tokenizer, _fold_system(messages), tools, template, where, kwargs)
        raise DataError(
            f"{where}: the chat template cannot render this conversation ({exc}); "
            + (_missing_field(str(exc), messages, tools) or "fix the messages or data.chat_template")
        ) from None


def _fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with the leading system message's content put before the first user turn's, as Gemma 3's
    template folds it."""
    system, first, *rest = messages
    return [{**first, "content": f"{system['content']}\n\n{first['content']}"}, *rest]


@_per_tokenizer_state(maxsize=32)
def drops_system(tokenizer: Any, template: str) -> bool:
    """Whether `template` renders no word of a leading system message in a conversation that ends with an
    answer. Mistral v0.3's own template writes the system prompt into the last user turn only when that turn
    ends the conversation (`loop.last`): at inference, never in a training conversation."""
    probe = [
        {"role": "system", "content": _SENTINEL},
        {"role": "user", "content": "ft-probe"},
        {"role": "assistant", "content": "ft-answer"},
    ]
    text = _probe(tokenizer, template, probe)
    return text is not None and _SENTINEL not in text


def with_system_shown(chat: ChatRecord, template: str, tokenizer: Any, train_from: int = 0) -> tuple[ChatRecord, int]:
    """The conversation with its leading system message folded into the first user turn where the template would
    leave it out of this conversation (`drops_system`: one that ends with an answer), and `train_from` moved
    with the messages; else both as given. Without it every record trained without its system prompt, which
    the model is then given at inference."""
    messages = chat.messages
    leading = messages[0]["role"] if messages else None
    if leading == "developer" and "developer" in template:  # gpt-oss's own role, rendered as such
        return chat, train_from
    if leading not in ("system", "developer") or len(messages) < 3 or messages[1]["role"] != "user":
        return chat, train_from
    if messages[-1]["role"] == "user" or not drops_system(tokenizer, template):  # a prompt shows it, as at inference
        return chat, train_from
    return ChatRecord(_fold_system(messages), chat.tools), max(train_from - 1, 0)


def _missing_field(message: str, messages: list[dict], tools: list[dict] | None) -> str | None:
    """What to add when the template read a field the record lacks (gpt-oss's reads every tool's
    `description`), or None when the error is another."""
    found = re.search(r"has no attribute '(\w+)'", message)
    if found is None:
        return None
    field = found.group(1)
    for tool in tools or []:
        function = tool.get("function", tool)
        if isinstance(function, dict) and field not in function:
            return f"tool {function.get('name', '?')!r} has no {field!r}, which this template reads: add it to the tool"
    for index, turn in enumerate(messages, start=1):
        if field not in turn:
            return f"message {index} ({turn.get('role')}) has no {field!r}, which this template reads: add it"
    return None


def render_chat(
    chat: ChatRecord,
    template: str,
    tokenizer: Any,
    where: str,
    reasoning: Reasoning = "template",
    train_from: int = 0,
) -> tuple[list[int], list[bool]]:
    """Token ids of the conversation as the template renders it, and for each whether it is trained (the
    assistant turns from message `train_from` on: reasoning, answer, tool calls and closing token; never
    system, user, tool results or the tool descriptions).

    `train_from` leaves earlier turns as context: a preference completion after its prompt, or the last
    turn of an `every_turn` example. Templates that render a turn differently once later turns exist
    (gpt-oss drops a tool call's analysis once a final answer follows) are handled, since turns are
    located in the whole rendering, not after a separately rendered prompt (with `{% generation %}` marks
    too: `_marked_turn_start`).
    """
    chat, train_from = with_system_shown(chat, template, tokenizer, train_from)
    if has_generation_marks(template):
        out = apply_template(
            tokenizer, chat, template, where, reasoning,
            tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
        )  # fmt: skip
        ids, flags = list(out["input_ids"]), [bool(flag) for flag in out["assistant_masks"]]
        if train_from:  # the marks cover every turn: keep those from turn `train_from` on
            keep = _marked_turn_start(chat, template, tokenizer, where, reasoning, train_from, ids, flags)
            flags = [flag and position >= keep for position, flag in enumerate(flags)]
        return ids, flags
    text, spans = render_turns(chat, template, tokenizer, where, reasoning, train_from)
    return tokens_of(tokenizer, text, spans)


def _marked_turn_start(
    chat: ChatRecord,
    template: str,
    tokenizer: Any,
    where: str,
    reasoning: Reasoning,
    train_from: int,
    ids: list[int],
    flags: list[bool],
) -> int:
    """The first token of turn `train_from` in a `{% generation %}` template's rendering `ids`: the start of the
    marked run that holds the turn's first word (found as `render_turns` finds it).

    Not the end of the prompt's own rendering: where a template renders a turn otherwise once later ones exist
    (gpt-oss drops a call's analysis once an answer follows) that is no prefix of `ids`, and the prompt's tool call
    would be trained with the completion. Where the prompt is a prefix, its generation prompt stays context, as
    before; the prompt's end is kept too for a turn the template renders no word of."""
    shown, render, _ = _renderer(chat, template, tokenizer, where, reasoning)
    prompt = ChatRecord(chat.messages[:train_from], chat.tools)
    after_prompt = common_prefix_length(render_chat_prompt(prompt, template, tokenizer, where, reasoning), ids)
    full = render(shown)
    turns = (i for i in range(train_from, len(shown)) if shown[i]["role"] == "assistant")
    found = (_differing(full, render([*shown[:i], _masked(shown[i]), *shown[i + 1 :]])) for i in turns)
    words = next((located for located in found if located is not None), None)
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    if words is None or list(encoded["input_ids"]) != ids:
        return after_prompt
    floor = _context_words_end(full, shown, train_from, render)
    offsets = encoded["offset_mapping"]
    first_word = keep = next((position for position, (_, end) in enumerate(offsets) if end > words[0]), len(ids))
    while keep and flags[keep - 1] and offsets[keep - 1][0] >= floor:  # back to the run's start (its header)
        keep -= 1
    return max(keep, after_prompt) if after_prompt <= first_word else keep  # the prompt's header stays context


def render_every_turn(
    chat: ChatRecord, template: str, tokenizer: Any, where: str, reasoning: Reasoning = "every_turn"
) -> list[tuple[list[int], list[bool]]]:
    """One example per assistant turn: the conversation up to and including that turn, only it trained.

    Templates that drop earlier turns' reasoning (Qwen3, gpt-oss after a final answer) render each turn's
    reasoning when it is the last, so every turn's reasoning is trained once, each time seen as at inference.
    """
    return [
        render_chat(ChatRecord(chat.messages[: index + 1], chat.tools), template, tokenizer, where, reasoning, index)
        for index, message in enumerate(chat.messages)
        if message["role"] == "assistant"
    ]


@_per_tokenizer_state(maxsize=32)
def renders_reasoning(tokenizer: Any, template: str) -> bool:
    """Whether `template` renders the reasoning of a conversation's last assistant turn. The DeepSeek-R1
    distills' cuts everything up to `</think>` from every assistant turn, so no reasoning is ever trained
    through it (trl ships a training variant that keeps it)."""
    probe = ChatRecord(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": _SENTINEL}]
    )
    return _SENTINEL in apply_template(tokenizer, probe, template, "a probe conversation", tokenize=False)


def render_chat_prompt(
    chat: ChatRecord, template: str, tokenizer: Any, where: str, reasoning: Reasoning = "template"
) -> list[int]:
    """Token ids of the conversation as a prompt: the template's generation prompt (the assistant's header)
    at the end, as at inference. The GRPO and DPO paths render their prompts with this."""
    rendered = apply_template(
        tokenizer, chat, template, where, reasoning, tokenize=True, return_dict=False, add_generation_prompt=True
    )
    return list(rendered)


def tokens_of(tokenizer: Any, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """Token ids of `text`, each flagged when it overlaps one of the character `spans`."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            "chat records rendered by a template without {% generation %} markers need a fast tokenizer "
            "(for character offsets); add the markers to data.chat_template"
        )
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    flags = [any(first < end and last > start for start, end in spans) for first, last in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), flags


class _Renderer(NamedTuple):
    shown: list[dict[str, Any]]
    """The messages as the template reads them."""
    render: Callable[..., str]
    """Renders a list of such messages to text (extra keyword arguments go to the template)."""
    template: str
    """The template as `render` uses it (`null_content_as_empty` where the template tests for null content)."""


def _renderer(chat: ChatRecord, template: str, tokenizer: Any, where: str, reasoning: Reasoning) -> _Renderer:
    """How a conversation is rendered: with the chat's tools and the reasoning mode's template arguments."""
    reads = template_reads(template)
    rendered_with = null_content_as_empty(template) if reads.null_content else template
    kwargs = template_kwargs(reasoning)

    def render(messages: list[dict[str, Any]], **extra: Any) -> str:
        return _apply(tokenizer, messages, chat.tools, rendered_with, where, {**kwargs, **extra, "tokenize": False})

    return _Renderer(for_template(chat.messages, reads, reasoning != "none"), render, rendered_with)


def render_turns(
    chat: ChatRecord,
    template: str,
    tokenizer: Any,
    where: str,
    reasoning: Reasoning = "template",
    train_from: int = 0,
) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's rendering and the character span each assistant turn from message `train_from`
    on trains (see the module docstring), in order; a turn the template renders nothing of has no span."""
    check_renders_tools(chat, template, where)
    shown, render, rendered_with = _renderer(chat, template, tokenizer, where, reasoning)
    full = render(shown)
    marks = turn_marks(tokenizer, rendered_with, json.dumps(template_kwargs(reasoning), sort_keys=True))
    spans: list[tuple[int, int]] = []
    floor = _context_words_end(full, shown, train_from, render)
    for index, message in enumerate(shown):
        if message["role"] != "assistant" or index < train_from:
            continue
        marked = render([*shown[:index], _masked(message), *shown[index + 1 :]])
        _check_calls_rendered(marked, message, f"{where}: messages[{index}]")
        words = _differing(full, marked)
        if words is None:  # the template renders none of this turn's words (DeepSeek's tool calls with text)
            continue
        start = marks.header_end(full, floor, words[0])
        if start is None:  # no generation prompt before this turn (Mistral's after a tool result)
            start = _start_without_header(full, shown, index, floor, words[0], marks, render)
        if index and not _shows(full, shown[index - 1], floor, start):
            raise DataError(
                f"{where}: the chat template renders text that depends on the assistant's words before the "
                f"turn (messages[{index}]), so assistant turns cannot be located; add {{% generation %}}..."
                "{% endgeneration %} around assistant output in data.chat_template, or set "
                "data.completion_only_loss=false"
            )
        bound = _next_message_at(full, shown, index, words[1], marks, render)
        end = marks.end_after(full, words[1], bound)
        spans.append((start, end))
        floor = end
    if spans and marks.last_turn_closer and spans[-1][1] == len(full) and shown[-1]["role"] == "assistant":
        full += marks.last_turn_closer
        spans[-1] = (spans[-1][0], len(full))
    return full, spans


def _context_words_end(full: str, messages: list[dict[str, Any]], train_from: int, render: Callable) -> int:
    """Where the words of the last assistant turn before message `train_from` end in `full` (0 if there is none).

    Turns left as context are not located, but the first trained turn's header is looked for after them: a turn
    that follows no header (Mistral's and DeepSeek's answers after tool results) would otherwise take the previous
    turn's header for its own, and train that turn and the tool results with it."""
    for index in range(train_from - 1, -1, -1):
        if messages[index]["role"] == "assistant":
            words = _differing(full, render([*messages[:index], _masked(messages[index]), *messages[index + 1 :]]))
            if words is not None:  # else the template renders none of its words: the turn before it bounds
                return words[1]
    return 0


def _masked(message: dict[str, Any]) -> dict[str, Any]:
    """The message with its words replaced by sentinels: content, reasoning, call arguments (names kept)."""
    out = dict(message)
    for key in ("content", "reasoning_content", "thinking"):
        if out.get(key):
            out[key] = _SENTINEL
    if out.get("tool_calls"):
        calls = []
        for number, call in enumerate(out["tool_calls"]):
            arguments: Any = {_call_key(number): _SENTINEL}
            if isinstance(call["function"]["arguments"], str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            calls.append({**call, "function": {**call["function"], "arguments": arguments}})
        out["tool_calls"] = calls
    if not message.get("content") and not message.get("tool_calls"):  # no answer: mark where it would go (a
        out["content"] = _SENTINEL  # template may drop the reasoning: the closing token is still found)
    return out


def _call_key(number: int) -> str:
    """The argument name a masked turn gives its call `number`: found in the rendering when the call is rendered."""
    return f"ft-call-{number}"


def _check_calls_rendered(marked: str, message: dict[str, Any], at: str) -> None:
    """Every tool call of the turn shows in its masked rendering. Templates drop calls without a word: gpt-oss's
    renders only a turn's first call, the DeepSeek-R1 distills' none on a turn with text; the turn would train
    as if the model stopped without calling, and its results would answer nothing."""
    calls = message.get("tool_calls") or []
    dropped = [number for number in range(len(calls)) if _call_key(number) not in marked]
    if not dropped:
        return
    names = ", ".join(f"tool_calls[{n}] ({calls[n]['function']['name']})" for n in dropped)
    raise DataError(
        f"{at}: the chat template does not render {names} of this turn's {len(calls)} tool call(s) (gpt-oss's "
        "renders one call per turn, the R1 distills' none on a turn with text, LFM2's none from tool_calls); give "
        "each call an assistant turn of its own followed by its result, leave the turn's text out, or write the "
        "calls into the text as the template's model writes them"
    )


def _differing(full: str, marked: str) -> tuple[int, int] | None:
    """The characters of `full` from the first to the last that differ from `marked`; None if none do."""
    if full == marked:
        return None
    limit = min(len(full), len(marked))
    start = 0
    while start < limit and full[start] == marked[start]:
        start += 1
    shared_end = 0
    while shared_end < limit - start and full[-1 - shared_end] == marked[-1 - shared_end]:
        shared_end += 1
    return start, len(full) - shared_end


def _forms(message: dict[str, Any]) -> list[str]:
    """How a message's content may show in a rendering: as is, trimmed, or as a JSON string; none for a blank
    content (a tool that returned nothing), whose JSON form `""` is text the template need not render."""
    content = message.get("content") or ""
    if not content.strip():
        return []
    return [form for form in (content, content.strip(), json.dumps(content, ensure_ascii=False)) if form.strip()]


def _shows(full: str, message: dict[str, Any], start: int, end: int) -> bool:
    """Whether `message` (the one before an assistant turn) shows in `full[start:end]`; an assistant message
    or one without content has nothing to look for."""
    forms = _forms(message) if message["role"] != "assistant" else []
    return not forms or any(full.find(form, start, end) >= 0 for form in forms)


def _start_without_header(
    full: str, messages: list[dict[str, Any]], index: int, floor: int, words_start: int, marks: TurnMarks, render
) -> int:
    """Where a turn that follows no generation prompt starts (Mistral's calls and answers after tool results,
    DeepSeek's after tool outputs): its wrapping before the words (`[TOOL_CALLS] [{"name": ...`) is the model's.

    That is where the conversation before it, rendered as a prompt, ends, as at inference. A template that renders
    earlier turns otherwise once later ones exist (Mistral's tools and system prompt go with the last user turn)
    gets the end of the first special token after the previous message's content instead; with neither, the words'
    start. A previous message with blank content (a tool that returned nothing) shows nowhere: the prompt then only
    has to end after the turn before."""
    if not index:
        return words_start
    previous = _content_end(full, messages[index - 1], floor, words_start)  # None: blank, as a tool's empty result
    try:
        prompt = render(messages[:index], add_generation_prompt=True)
    except DataError:  # a template that refuses to end on this message
        prompt = ""
    if prompt and (floor if previous is None else previous) <= len(prompt) <= words_start and full.startswith(prompt):
        return len(prompt)
    return words_start if previous is None else marks.after_special(full, previous, words_start)


def _content_end(full: str, message: dict[str, Any], floor: int, before: int) -> int | None:
    """Where `message`'s content ends in `full[floor:before]` (its last showing); None if it has none or it does
    not show."""
    for form in _forms(message):
        found = full.rfind(form, floor, before)
        if found >= 0:
            return found + len(form)
    return None


def _next_message_at(
    full: str, messages: list[dict[str, Any]], index: int, after: int, marks: TurnMarks, render: Callable
) -> int:
    """Where the message after `index` shows in `full` (its content, or the next assistant header): the
    turn's closing token must come before it.

    Its content is looked for as text; where that text also shows between the words and the closing token
    (a tool result `1` inside Mistral's call id, `}` in a call's JSON), it says nothing of where the message
    is, which is then found exactly: the conversation rendered with that message's content replaced by a
    sentinel (one more rendering, only then)."""
    bound = marks.next_header(full, after)
    if index + 1 >= len(messages):
        return bound
    following = messages[index + 1]
    found = next((at for form in _forms(following) if (at := full.find(form, after)) >= 0), None)
    if found is None or found >= bound:
        return bound
    closer = marks.first_closer(full, after)
    if closer is None or closer[0] < found:
        return found
    marked = render([*messages[: index + 1], {**following, "content": _SENTINEL}, *messages[index + 2 :]])
    located = _differing(full, marked)
    return located[0] if located is not None and located[0] >= after else found


@dataclass(frozen=True)
class TurnMarks:
    """A template's generation prompt (the candidates for an assistant header, longest first) and the
    tokens that close an assistant turn."""

    headers: tuple[str, ...]
    closers: tuple[str, ...]
    specials: tuple[str, ...] = ()
    """The tokenizer's special tokens: where a turn follows no header, the one closing the message before it."""
    last_turn_closer: str = ""
    """Where the template closes no turn with a token of its own (GLM), the opener of a user turn: a conversation
    ending with an answer gets it after that answer, trained, so the model learns to stop (its stop token)."""

    def header_end(self, full: str, floor: int, words_start: int) -> int | None:
        """After the longest header that ends in `full[floor:words_start]` (its last occurrence); None if none does."""
        window = full[floor:words_start]
        for header in self.headers:
            found = window.rfind(header)
            if found >= 0:
                return floor + found + len(header)
        return None

    def after_special(self, full: str, after: int, before: int) -> int:
        """After the first special token in `full[after:before]` (the longest where several start there), else
        `before`."""
        hits = [(at, -len(token)) for token in self.specials if (at := full.find(token, after, before)) >= 0]
        if not hits:
            return before
        at, negative_length = min(hits)
        return at - negative_length

    def end_after(self, full: str, words_end: int, bound: int) -> int:
        """Through the first closing token after the words (and closing tokens right after it), when it
        comes before `bound`; else the words' end."""
        found = self.first_closer(full, words_end)
        if found is None or found[0] >= bound:
            return words_end
        at, token = found
        end = at + len(token)
        while (following := next((t for t in self.closers if full.startswith(t, end)), None)) is not None:
            end += len(following)
        return end

    def first_closer(self, full: str, after: int) -> tuple[int, str] | None:
        """The first closing token at or after `after` (the longest where several start there), and where."""
        found = [(at, token) for token in self.closers if (at := full.find(token, after)) >= 0]
        return min(found, key=lambda hit: (hit[0], -len(hit[1])), default=None)

    def next_header(self, full: str, after: int) -> int:
        hits = [at for header in self.headers[:1] if (at := full.find(header, after)) >= 0]
        return min(hits, default=len(full))


@_per_tokenizer_state(maxsize=64)
def turn_marks(tokenizer: Any, template: str, kwargs_json: str = "{}") -> TurnMarks:
    """The template's `TurnMarks`, probed once per tokenizer, template and template variables (as JSON).

    The generation prompt is what rendering a user turn with `add_generation_prompt` adds; a template
    without one (Mistral's) has the last special token between a user turn and an answer instead. Its
    shorter forms (cut after a newline or a special token) are headers too: a template may render less of
    it in a turn than at inference (DeepSeek-R1's `<think>\n`, Qwen3's empty think block of earlier turns).
    """
    kwargs = json.loads(kwargs_json)
    user = [{"role": "user", "content": "ft-probe"}]

    def render(messages: list[dict[str, Any]], **extra: Any) -> str:
        return _apply(tokenizer, messages, None, template, "the chat template", {**kwargs, **extra, "tokenize": False})

    specials = sorted(_special_tokens(tokenizer), key=len, reverse=True)
    prompt, plain = render(user, add_generation_prompt=True), render(user)
    generation = prompt[common_prefix_length(prompt, plain) :]
    answered = render([*user, {"role": "assistant", "content": _SENTINEL}])
    if not generation.strip():  # no generation prompt (Mistral's): the last special token before the words
        between = answered[answered.find("ft-probe") + len("ft-probe") : answered.find(_SENTINEL)]
        generation = next((between[between.rfind(t) :] for t in specials if t in between), between).rstrip()
        generation = _up_to_last_special(generation, specials)
    headers = {generation}
    for cut in range(1, len(generation)):
        if generation[cut - 1] == "\n" or any(generation[:cut].endswith(t) for t in specials):
            headers.add(generation[:cut])
    closers = set(_KNOWN_CLOSERS)  # distinctive strings: found in the text even where the vocabulary splits them
    if tokenizer.eos_token:
        closers.add(tokenizer.eos_token)
    after = answered[answered.find(_SENTINEL) + len(_SENTINEL) :].lstrip()
    closer = next((t for t in specials if after.startswith(t)), None)
    if closer:
        closers.add(closer)
    last = ""
    if not closer and not any(after.startswith(t) for t in closers):
        openers = _next_turn_openers(render, specials)
        closers.update(openers.values())
        last = openers.get("user", "")
    headers_longest_first = tuple(sorted((h for h in headers if h.strip()), key=len, reverse=True))
    return TurnMarks(headers_longest_first, tuple(sorted(closers)), tuple(specials), last)


def _next_turn_openers(render: Callable[..., str], specials: list[str]) -> dict[str, str]:
    """A template that closes no assistant turn with a token of its own (GLM's) ends it where the next turn opens,
    and its models stop on those openers (GLM-4 on `<|user|>` and `<|observation|>`): the special token that opens
    a user turn and a tool result after an answer, trained as the turn's end (as trl's GLM training template
    marks them)."""
    openers = {}
    answer = {"role": "assistant", "content": _SENTINEL}
    for role in ("user", "tool"):
        try:
            text = render([{"role": "user", "content": "ft-probe"}, answer, {"role": role, "content": "ft-next"}])
        except DataError:  # a template that refuses a tool result without a call
            continue
        between = text[text.find(_SENTINEL) + len(_SENTINEL) : text.find("ft-next")]
        opener = next((t for t in specials if between.lstrip().startswith(t)), None)
        if opener:
            openers[role] = opener
    return openers


def _up_to_last_special(text: str, specials: list[str]) -> str:
    ends = [text.rfind(t) + len(t) for t in specials if t in text]
    return text[: max(ends)] if ends else text


def _special_tokens(tokenizer: Any) -> set[str]:
    return {t for t in (*tokenizer.all_special_tokens, *tokenizer.get_added_vocab()) if t}


def common_prefix_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items (tokens, characters) `a` and `b` share."""
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length
