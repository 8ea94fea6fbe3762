"""`finetune serve` with tools: a conversation with tool calls, tool results and reasoning is prompted with the
token ids training renders for it, and replies are read back into OpenAI `tool_calls` and `reasoning_content`.

Tiny models carry the families' real chat templates (trl's `chat_templates/`, Mistral's tool template in
`tests/chat_templates/`), through `test_chat_tools.family_tokenizer`. The prompt is checked against the training
pipeline's own prompt rendering (`finetune.data.formats.encode_chat_prompt`, what GRPO and DPO prompts use).
Replies are parsed from what training trains each family's assistant turns to write (the trained spans of the
real rendering), since a tiny random model writes no call of its own.
"""

from __future__ import annotations

import json
import warnings

import httpx
import pytest
from helpers import TEST_SHAPE
from openai.types.chat import ChatCompletionMessage
from test_chat_tools import FAMILIES, MESSAGES, RECORD, TOOLS, TRL_TEMPLATES, family_tokenizer, trained_runs

from finetune.data.chat import ChatRecord, normalize_messages, normalize_record
from finetune.data.chat_turns import render_chat, render_chat_prompt
from finetune.data.formats import encode_chat_prompt
from finetune.embedded.tiny import build_tiny_llama
from finetune.recipe import DataConfig
from finetune.serve.app import _read_reply
from finetune.serve.batcher import Finished
from finetune.serve.protocol import chat_body
from finetune.serve.replies import ReplyParser
from finetune.serve.server import ServerThread
from finetune.serve.settings import ServeSettings
from finetune.serve.textstream import TextStream

pytestmark = pytest.mark.skipif(not TRL_TEMPLATES.is_dir(), reason="trl (the test extra) ships the templates")
SERVED = ("qwen3", "qwen2.5", "llama-3.1", "mistral-v0.3")
PROMPT = MESSAGES[:4]  # system, user, the call (with reasoning), its result: the model answers next
PARIS = {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def family(name: str):
    return next(f for f in FAMILIES if f.name == name)


def call_turn(name: str) -> str:
    """What training trains the family's call turn to write, without its closing token: a real template output."""
    tokenizer = family_tokenizer(family(name))
    ids, trained = render_chat(normalize_record(RECORD, "messages", "r"), tokenizer.chat_template, tokenizer, "r")
    first = trained_runs(ids, [t if keep else -100 for t, keep in zip(ids, trained)], tokenizer)[0]
    return first.removesuffix(family(name).eos)


@pytest.fixture(scope="module", params=SERVED)
def served(request, tmp_path_factory):
    tokenizer = family_tokenizer(family(request.param))
    tokenizer.pad_token = tokenizer.eos_token
    path = tmp_path_factory.mktemp(request.param)
    build_tiny_llama(tokenizer, seed=0, **{**TEST_SHAPE, "max_position_embeddings": 2048}).save_pretrained(path)
    tokenizer.save_pretrained(path)
    settings = ServeSettings(base=str(path), base_name="tiny", port=0, max_wait_ms=5, max_tokens_limit=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ServerThread(settings) as running, httpx.Client(base_url=running.url, timeout=120) as client:
            yield request.param, tokenizer, running, client


def chat(client: httpx.Client, messages: list, **extra) -> httpx.Response:
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    return client.post("/v1/chat/completions", json={**body, **extra})


def test_a_conversation_with_tools_is_prompted_with_the_training_prompt_ids(served):
    name, tokenizer, _, client = served
    response = chat(client, PROMPT, tools=TOOLS)
    assert response.status_code == 200, response.text
    body = response.json()
    config = DataConfig(train=["unused.jsonl"], format="chat", max_seq_len=2048)
    expected = encode_chat_prompt(PROMPT, config, tokenizer, "record 1", tools=TOOLS)
    assert body["choices"][0]["prompt_token_ids"] == expected
    assert body["usage"]["prompt_tokens"] == len(expected)
    rendered = tokenizer.decode(expected)
    assert "get_weather" in rendered and "18 C, sunny" in rendered and "Paris" in rendered
    if name == "qwen3":  # the pending call's reasoning is shown at inference, under the field Qwen3 reads
        assert "I should call the tool." in rendered


def test_a_served_reply_in_the_familys_format_is_read_as_tool_calls(served):
    name, tokenizer, running, _ = served
    turn = call_turn(name)
    ids = tokenizer(turn, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    prompt = running.engine.encode_chat(PROMPT[:2], TOOLS)
    result = Finished(0, tokenizer.decode(ids, skip_special_tokens=True), "stop", prompt, ids)
    body = chat_body("chatcmpl-1", "tiny", 0, result, False, _read_reply(running.engine, result, tools=True))
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"]
    assert {"name": call["function"]["name"], "arguments": call["function"]["arguments"]} == PARIS
    if "<think>" in turn:
        assert choice["message"]["reasoning_content"] == "I should call the tool."
    without = chat_body("chatcmpl-1", "tiny", 0, result, False, _read_reply(running.engine, result, tools=False))
    assert without["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in without["choices"][0]["message"]


def test_a_call_cut_off_by_a_stop_sequence_is_still_read_as_a_call(served):
    """A stop sequence ends the reply after the call: its text (special tokens skipped, as streamed) lost Mistral's
    `[TOOL_CALLS]` token, and the call came back as content."""
    name, tokenizer, running, _ = served
    ids = tokenizer(call_turn(name) + "\nEND\nmore", add_special_tokens=False)["input_ids"]
    stream, generated = TextStream(running.engine.decode_text, ("\nEND",)), []
    for token in ids:  # as the batcher feeds the tokens, up to the one that completes the stop sequence
        generated.append(token)
        stream.push(token)
        if stream.stopped:
            break
    prompt = running.engine.encode_chat(PROMPT[:2], TOOLS)
    result = Finished(0, stream.text, "stop", prompt, generated)
    (choice,) = chat_body("c", "tiny", 0, result, False, _read_reply(running.engine, result, tools=True))["choices"]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert {"name": call["function"]["name"], "arguments": call["function"]["arguments"]} == PARIS


def test_a_call_the_model_wrote_without_an_id_can_be_sent_back(served):
    """The agent loop's next turn: the call as the server returned it, then its result. A call read without an
    id got `call_<24 hex>`, which Mistral's template refuses (it renders only 9 letters and digits): a 400."""
    name, tokenizer, running, client = served
    turn = call_turn(name).replace(', "id": "call00001"', "")
    ids = tokenizer(turn, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    prompt = running.engine.encode_chat(PROMPT[:2], TOOLS)
    result = Finished(0, tokenizer.decode(ids, skip_special_tokens=True), "stop", prompt, ids)
    message = chat_body("c", "tiny", 0, result, False, _read_reply(running.engine, result, tools=True))["choices"][0]
    (call,) = message["message"]["tool_calls"]
    answer = {"role": "tool", "tool_call_id": call["id"], "content": "18 C, sunny"}
    response = chat(client, [*PROMPT[:2], message["message"], answer], tools=TOOLS)
    assert response.status_code == 200, response.text
    if name == "mistral-v0.3":  # the id is in the prompt, as the template renders it
        assert call["id"].isalnum() and len(call["id"]) == 9, call["id"]
        assert call["id"] in tokenizer.decode(response.json()["choices"][0]["prompt_token_ids"])


def test_a_streamed_reply_with_tools_ends_with_its_finish_reason(served):
    _, _, _, client = served
    with client.stream("POST", "/v1/chat/completions", json={"model": "tiny", "messages": PROMPT, "tools": TOOLS,
                                                             "max_tokens": 3, "temperature": 0, "stream": True}) as r:  # fmt: skip
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop", "tool_calls")


BAD = [
    ({"messages": [*PROMPT[:2], {**PROMPT[2], "tool_calls": [{"id": "c1", "type": "function",
                                                              "function": {"name": "get_weather", "arguments": "{city"}}]}]},
     "messages", "are not valid JSON"),
    ({"messages": [PROMPT[1], PROMPT[3]]}, "messages", "tool result with no tool call before it"),
    ({"messages": [PROMPT[1], {"role": "assistant", "content": None}]}, "messages", "calls no tools"),
    ({"messages": PROMPT, "tools": [{"type": "function", "function": {"description": "x"}}]}, "tools.0.function.name",
     "tools.0.function.name"),
    ({"messages": PROMPT, "tools": [{"type": "function", "function": {"name": "other"}}]}, "messages",
     "which is not in the tools"),
    ({"messages": PROMPT, "tools": TOOLS, "tool_choice": "required"}, "tool_choice", "tool_choice"),
    ({"messages": [*PROMPT[:3], {**PROMPT[3], "tool_call_id": "nope"}]}, "messages", "answers tool_call_id 'nope'"),
    ({"messages": [*PROMPT[:2], {**PROMPT[2], "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]},
     "messages.2.tool_calls.0.function.arguments", "arguments"),
    ({"messages": [*PROMPT[:2], {**PROMPT[2], "refusal": "I will not."}]}, "messages.2.refusal", "only null"),
    ({"messages": [*PROMPT[:2], {**PROMPT[2], "annotations": [{"type": "url_citation"}]}]}, "messages.2.annotations",
     "only null or []"),
]  # fmt: skip


def test_a_bad_tool_conversation_is_a_one_line_400_naming_the_field(served):
    _, _, _, client = served
    for body, param, fragment in BAD:  # a 400 costs no generation: every case on every family's server
        response = chat(client, **body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and fragment in error["message"] and "\n" not in error["message"], error


@pytest.mark.parametrize("content", ["", "\n\n"])
def test_an_empty_reply_sent_back_in_the_history_is_rendered_as_the_template_renders_it(served, content):
    """A reply of no text (the model ended its turn at once) or of blank text, sent back with the next question
    as OpenAI's API takes it, was a 400 ("content is empty on an assistant turn"), a rule for trained turns."""
    _, tokenizer, _, client = served
    history = [PROMPT[1], {"role": "assistant", "content": content}, {"role": "user", "content": "And Rome?"}]
    response = chat(client, history)
    assert response.status_code == 200, response.text
    expected = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert response.json()["choices"][0]["prompt_token_ids"] == list(expected)
    assert chat(client, [PROMPT[1], {"role": "assistant", "content": None}]).status_code == 400  # as OpenAI's


@pytest.mark.parametrize("name", ["deepseek-r1-distill", "deepseek-v3"])
def test_an_empty_reply_is_a_turn_also_in_a_template_that_tests_for_null_content(name):
    """DeepSeek's templates render tool calls where `content is none`, which reads `""` as null so that a call
    turn (given `""` for null) renders: an empty turn without calls took that branch and rendered nothing."""
    tokenizer = family_tokenizer(family(name))
    history = [PROMPT[1], {"role": "assistant", "content": ""}, {"role": "user", "content": "And Rome?"}]
    chat_record = ChatRecord(normalize_messages(history, "request", context_only=True))
    ids = render_chat_prompt(chat_record, tokenizer.chat_template, tokenizer, "request")
    expected = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == list(expected) and tokenizer.decode(ids).count("<｜Assistant｜>") == 2


def test_an_assistant_message_echoed_as_the_openai_client_dumps_it_is_taken(served):
    """`messages.append(reply.message.model_dump())`: the openai client's message carries `refusal`, `audio`,
    `function_call` and `annotations` as null (OpenAI's own assistant message fields); they were a 400."""
    _, tokenizer, _, client = served
    echoed = ChatCompletionMessage.model_validate(PROMPT[2]).model_dump()
    assert {"refusal", "audio", "function_call", "annotations"} <= echoed.keys()
    response = chat(client, [*PROMPT[:2], echoed, PROMPT[3]], tools=TOOLS)
    assert response.status_code == 200, response.text
    plain = chat(client, PROMPT, tools=TOOLS).json()["choices"][0]["prompt_token_ids"]
    assert response.json()["choices"][0]["prompt_token_ids"] == plain  # the nulls change nothing in the prompt
    empty_annotations = {**echoed, "annotations": []}
    assert chat(client, [*PROMPT[:2], empty_annotations, PROMPT[3]], tools=TOOLS).status_code == 200


REPLIES = [
    ("qwen3", '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "b", '
     '"arguments": {}}\n</tool_call>', None, [("a", '{"x": 1}'), ("b", "{}")]),
    ("qwen3", 'Let me look.\n<tool_call>\n{"name": "a", "arguments": {"q": "é"}}\n</tool_call>', "Let me look.",
     [("a", '{"q": "é"}')]),
    ("mistral-v0.3", '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}, "id": "abcdefghi"}, {"name": "b", '
     '"arguments": {}}]', None, [("a", '{"x": 1}'), ("b", "{}")]),
    ("llama-3.1", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}', None, [("a", '{"x": 1}')]),
]  # fmt: skip


@pytest.mark.parametrize(("name", "text", "content", "calls"), REPLIES, ids=[r[0] for r in REPLIES])
def test_each_familys_call_format_parses(name, text, content, calls):
    reply = ReplyParser.for_tokenizer(family_tokenizer(family(name))).parse(text)
    assert reply is not None and reply.content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in reply.tool_calls] == calls
    assert all(c["type"] == "function" and c["id"] for c in reply.tool_calls)
    if name == "mistral-v0.3":
        assert reply.tool_calls[0]["id"] == "abcdefghi"  # the model's own id, which its next turn refers to


UNREAD = ['<tool_call>\n{"name": "a", bad}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>',
          "just an answer", '<tool_call>\n{"name": "a", "arguments": [1]}\n</tool_call>']  # fmt: skip


@pytest.mark.parametrize("text", UNREAD)
def test_what_does_not_parse_stays_the_text(text):
    assert ReplyParser.for_tokenizer(family_tokenizer(family("qwen3"))).parse(text) is None


@pytest.mark.parametrize(
    "text", UNREAD[:2] + ["<tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"]
)
def test_a_call_that_does_not_parse_stays_the_text_and_its_reasoning_is_still_read(text):
    """With tools, a reply whose call did not parse came back whole as `content`, reasoning and `</think>`
    included, where the same reply without tools had its reasoning read."""
    qwen = ReplyParser.for_tokenizer(family_tokenizer(family("qwen3")))
    reply = qwen.parse(f"<think>\nHm.\n</think>\n\n{text}", tools=True)
    assert reply is not None and (reply.reasoning, reply.content, reply.tool_calls) == ("Hm.", text, ())
    r1 = ReplyParser.for_tokenizer(family_tokenizer(family("deepseek-r1-distill-tools")))
    reply = r1.parse(f"Hm.\n</think>\n\n{text}", prompt_text="<｜Assistant｜><think>\n", tools=True)
    assert reply is not None and (reply.reasoning, reply.content) == ("Hm.", text)


def test_an_xml_style_tool_call_in_a_tool_call_tag_stays_the_text():
    """GLM-4-MoE (and Qwen3.5's, Nemotron 3's) write XML-style calls inside `<tool_call>`: not read as Hermes."""
    glm = ReplyParser.for_tokenizer(family_tokenizer(family("glm-4-moe")))
    reply = glm.parse(call_turn("glm-4-moe").removesuffix("<|observation|>"))
    assert reply is not None and not reply.tool_calls and reply.reasoning == "I should call the tool."
    assert reply.content is not None and reply.content.startswith("<tool_call>get_weather\n<arg_key>city")


def test_reasoning_is_read_also_where_the_prompt_opened_it_and_in_every_family():
    r1 = ReplyParser.for_tokenizer(family_tokenizer(family("deepseek-r1-distill")))
    reply = r1.parse("It is mild.\n</think>\n\nParis: 18 C.", prompt_text="<｜Assistant｜><think>\n")
    assert reply is not None and (reply.reasoning, reply.content) == ("It is mild.", "Paris: 18 C.")
    llama = ReplyParser.for_tokenizer(family_tokenizer(family("llama-3.1")))
    reply = llama.parse("<think>\nHm.\n</think>\n\nSunny.")
    assert reply is not None and (reply.reasoning, reply.content, reply.tool_calls) == ("Hm.", "Sunny.", ())
    assert reply.message() == {"role": "assistant", "content": "Sunny.", "reasoning_content": "Hm."}
