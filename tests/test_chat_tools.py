"""Tool-calling and reasoning conversations on the real chat templates of each family, read back through
`finetune data preview --json`: exactly the assistant turns (reasoning as rendered, answer, tool calls,
closing token) are trained; system, user, tool results and tool descriptions never.

Templates are the families' own, as trl 1.16 ships them (`trl/chat_templates/`, read as files, trl is not
imported) plus Mistral v0.3's tool template in `tests/chat_templates/`. Each tiny tokenizer carries the
family's special tokens. The expected spans below were located by hand in the renderings; trl's training
templates (`{% generation %}` marks, `return_assistant_tokens_mask`) are the independent reference where
they render the same text.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from finetune.cli import main
from finetune.data.chat import ChatRecord, normalize_record
from finetune.data.chat_turns import render_chat
from finetune.data.formats import encode_chat_prompt
from finetune.data.pipeline import build_datasets
from finetune.data.preference import preview_records
from finetune.errors import DataError
from finetune.recipe import DataConfig

_TRL = importlib.util.find_spec("trl")
TRL_TEMPLATES = Path(_TRL.origin).parent / "chat_templates" if _TRL and _TRL.origin else Path("/nonexistent")
TESTS = Path(__file__).parent / "chat_templates"
pytestmark = pytest.mark.skipif(not TRL_TEMPLATES.is_dir(), reason="trl (the test extra) ships the templates")

SYSTEM = "You report the weather."
QUESTION = "Weather in Paris?"
RESULT = "18 C, sunny"
DESCRIPTION = "Weather of a city"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip
CALL = {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "content": None, "reasoning_content": "I should call the tool.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": RESULT},
    {"role": "assistant", "reasoning_content": "It is mild.", "content": "Paris: 18 C and sunny."},
]
RECORD = {"tools": TOOLS, "messages": MESSAGES}
ANSWER_WITH_THINKING = "<think>\nIt is mild.\n</think>\n\nParis: 18 C and sunny."


@dataclass(frozen=True)
class Family:
    name: str
    template: Path
    bos: str | None
    eos: str
    specials: tuple[str, ...]
    trained: tuple[str, ...]
    """The trained text of each assistant turn, located by hand in the rendering."""
    record: dict = None  # type: ignore[assignment]


QWEN = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
LLAMA = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>")
HARMONY = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>", "<|constrain|>")
MISTRAL = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
           "[/TOOL_RESULTS]")  # fmt: skip
DEEPSEEK = ("<｜User｜>", "<｜Assistant｜>")
GLM = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
WITHOUT_TOOLS = {"messages": [m for m in MESSAGES if m["role"] != "tool" and "tool_calls" not in m]}
DEEPSEEK_CALL = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>'

FAMILIES = [
    # Qwen3 reads reasoning_content and renders it for the turns after the last user message.
    Family("qwen3", TRL_TEMPLATES / "qwen3.jinja", None, "<|im_end|>", QWEN,
           ("<think>\nI should call the tool.\n</think>\n\n" + QWEN_CALL, ANSWER_WITH_THINKING + "<|im_end|>")),
    # Qwen2.5 has no reasoning field: it is given inline, as the content's leading <think>; a tool-call
    # turn renders its content (here only the reasoning) before the call.
    Family("qwen2.5", TRL_TEMPLATES / "qwen2_5.jinja", None, "<|im_end|>", QWEN,
           ("<think>\nI should call the tool.\n</think>\n\n\n" + QWEN_CALL, ANSWER_WITH_THINKING + "<|im_end|>")),
    # Llama 3.1/3.2: a tool-call turn renders the call as JSON only (its text and reasoning are dropped).
    Family("llama-3.1", TRL_TEMPLATES / "llama3_1.jinja", "<|begin_of_text|>", "<|eot_id|>", LLAMA,
           (LLAMA_CALL, ANSWER_WITH_THINKING + "<|eot_id|>")),
    Family("llama-3.2", TRL_TEMPLATES / "llama3_2.jinja", "<|begin_of_text|>", "<|eot_id|>", LLAMA,
           (LLAMA_CALL, ANSWER_WITH_THINKING + "<|eot_id|>")),
    # gpt-oss: the model writes after `<|start|>assistant`; the call's analysis is dropped once a final
    # answer follows; the last turn's analysis and final channels are one trained span.
    Family("gpt-oss", TRL_TEMPLATES / "gptoss.jinja", None, "<|return|>", HARMONY,
           (' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
            "<|channel|>analysis<|message|>It is mild.<|end|><|start|>assistant<|channel|>final<|message|>"
            "Paris: 18 C and sunny.<|return|>")),
    # Mistral v0.3: no generation prompt after a tool result; the answer's leading space is the template's
    # (`" " + content`), written by the model as after `[/INST]`.
    Family("mistral-v0.3", TESTS / "mistral-v0.3-tools.jinja", "<s>", "</s>", MISTRAL,
           ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}]</s>',
            " " + ANSWER_WITH_THINKING + "</s>")),
    # The R1 distills' template drops the reasoning (everything to `</think>`) from every turn, and
    # cannot render a tool call next to text: a reasoning conversation without tools.
    Family("deepseek-r1-distill", TRL_TEMPLATES / "deepseek_r1_distill.jinja", "<｜begin▁of▁sentence｜>",
           "<｜end▁of▁sentence｜>", DEEPSEEK, ("\n\nParis: 18 C and sunny.<｜end▁of▁sentence｜>",), WITHOUT_TOOLS),
    # With tools, the R1 distills' template renders a turn's calls only when it has no text (`content is none`,
    # which transformers cannot pass: `chat.null_content_as_empty`), so the call turn's reasoning is left out,
    # and it closes a single call without `<｜tool▁calls▁end｜>`; the answer after tool results keeps its text whole.
    Family("deepseek-r1-distill-tools", TRL_TEMPLATES / "deepseek_r1_distill.jinja", "<｜begin▁of▁sentence｜>",
           "<｜end▁of▁sentence｜>", DEEPSEEK,
           (DEEPSEEK_CALL, ANSWER_WITH_THINKING + "<｜end▁of▁sentence｜>"), RECORD),
    # GLM-4-MoE closes no turn with a token of its own: a turn ends where the next opens, and its models stop on
    # those openers, so they are trained (after the last answer the user opener is added), as trl's GLM training
    # template marks them.
    Family("glm-4-moe", TRL_TEMPLATES / "glm4moe.jinja", None, "<|endoftext|>", GLM,
           ("\n<think>I should call the tool.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
            "<arg_value>Paris</arg_value>\n</tool_call><|observation|>",
            "\n<think>It is mild.</think>\nParis: 18 C and sunny.<|user|>")),
    # DeepSeek-V3 renders the call turn's text (the reasoning, inline) before its calls.
    Family("deepseek-v3", TRL_TEMPLATES / "deepseekv3.jinja", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
           DEEPSEEK, ("<think>\nI should call the tool.\n</think>\n\n" + DEEPSEEK_CALL
                      + "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>", ANSWER_WITH_THINKING + "<｜end▁of▁sentence｜>"),
           RECORD),
]  # fmt: skip


def family_tokenizer(family: Family, template: Path | None = None) -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer with the family's special tokens and chat template."""
    specials = list(dict.fromkeys(t for t in (family.bos, family.eos, *family.specials) if t))
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    backend.train_from_iterator([SYSTEM, QUESTION, RESULT, DESCRIPTION, json.dumps(MESSAGES)] * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=family.bos, eos_token=family.eos,
                                        additional_special_tokens=specials)  # fmt: skip
    tokenizer.chat_template = (template or family.template).read_text()
    return tokenizer


def trained_runs(input_ids: list[int], labels: list[int], tokenizer) -> list[str]:
    """The decoded text of each maximal run of trained tokens."""
    runs, current = [], []
    for token, label in zip([*input_ids, None], [*labels, -100]):
        if label != -100:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


def preview_json(tmp_path: Path, tokenizer, record: dict, capsys, *overrides: str) -> list[dict]:
    """`finetune data preview --json` on one record (tokenizer only: `model.tokenizer`)."""
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    (tmp_path / "chat.jsonl").write_text(json.dumps(record) + "\n")
    recipe = {"model": {"base": "embedded:tiny-llama", "tokenizer": str(tmp_path / "tokenizer")},
              "data": {"train": str(tmp_path / "chat.jsonl"), "format": "chat", "max_seq_len": 2048},
              "output": {"name": "x"}}  # fmt: skip
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    assert main(["data", "preview", str(tmp_path / "recipe.yaml"), "--json", "--limit", "9", *overrides]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_tool_calls_and_reasoning_train_exactly_the_assistant_turns(family, tmp_path, capsys):
    tokenizer = family_tokenizer(family)
    record = family.record or RECORD
    (document,) = preview_json(tmp_path, tokenizer, record, capsys)
    runs = trained_runs(document["input_ids"], document["labels"], tokenizer)
    assert runs == list(family.trained), tokenizer.decode(document["input_ids"])
    rendered = tokenizer.decode(document["input_ids"])
    untrained = [SYSTEM, QUESTION, RESULT, DESCRIPTION] if family.record is None else [SYSTEM, QUESTION]
    for text in untrained:
        assert text in rendered, text  # Mistral's system prompt too (`test_a_system_prompt_the_template_...`)
        assert all(text not in run for run in runs), text


def test_a_system_prompt_the_template_leaves_out_of_answered_conversations_is_folded_into_the_first_user_turn(
    tmp_path, capsys
):
    """Mistral v0.3's own template writes the system prompt into the last user turn only when that turn ends the
    conversation (at inference), so every training conversation, which ends with an answer, lost it without a
    word: the model was tuned without the prompt it is then given. It is folded into the first user turn, as for
    Gemma 2; a prompt (generation prompt at the end) is rendered by the template itself, as at inference."""
    mistral = next(f for f in FAMILIES if f.name == "mistral-v0.3")
    tokenizer = family_tokenizer(mistral)
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Tomorrow?"},
            {"role": "assistant", "content": "Rain."}]  # fmt: skip
    folded = f"<s>[INST] {SYSTEM}\n\n{QUESTION}[/INST] Sunny.</s>[INST] Tomorrow?[/INST] Rain.</s>"
    (document,) = preview_json(tmp_path, tokenizer, {"messages": chat}, capsys)
    assert tokenizer.decode(document["input_ids"]) == folded
    assert trained_runs(document["input_ids"], document["labels"], tokenizer) == [" Sunny.</s>", " Rain.</s>"]
    every_turn = preview_json(tmp_path, tokenizer, {"messages": chat}, capsys, "data.reasoning=every_turn")
    assert [tokenizer.decode(d["input_ids"]) for d in every_turn] == [folded[: folded.index("[INST] Tomorrow")], folded]
    # A preference pair: the prompt's system message shows before its question, untrained.
    pair = {"prompt": chat[:2], "chosen": [chat[2]], "rejected": [{"role": "assistant", "content": "Snow."}]}
    (tmp_path / "pairs.jsonl").write_text(json.dumps(pair) + "\n")
    config = DataConfig(train=str(tmp_path / "pairs.jsonl"), format="preference", max_seq_len=256)
    ((_, row),) = preview_records(config, tokenizer, limit=1)
    assert tokenizer.decode(row["chosen_input_ids"]) == folded[: folded.index("[INST] Tomorrow")]
    assert trained_runs(row["rejected_input_ids"], row["rejected_labels"], tokenizer) == [" Snow.</s>"]
    # A prompt is the template's own rendering: the system prompt with the last user turn, as at inference.
    prompt = encode_chat_prompt(chat[:4], config, tokenizer, "a prompt")
    assert tokenizer.decode(prompt) == f"<s>[INST] {QUESTION}[/INST] Sunny.</s>[INST] {SYSTEM}\n\nTomorrow?[/INST]"


# trl's training templates wrap the header's newline (Qwen) or the whole `<|start|>assistant` header
# (gpt-oss) and the newline after the closing token in their marks: those are the only tokens they
# train and we do not, since the generation prompt already wrote them at inference.
REFERENCES = [("qwen3", "qwen3_training.jinja", "\n"), ("qwen2.5", "qwen2_5_training.jinja", "\n"),
              ("gpt-oss", "gptoss_training.jinja", "<|start|>assistant")]  # fmt: skip


@pytest.mark.parametrize(("name", "training", "header"), REFERENCES, ids=[r[0] for r in REFERENCES])
def test_masks_equal_trl_assistant_masks_on_its_training_templates_but_for_the_header(name, training, header):
    family = next(f for f in FAMILIES if f.name == name)
    tokenizer = family_tokenizer(family)
    chat = normalize_record(RECORD, "messages", "record 1")
    ids, ours = render_chat(chat, tokenizer.chat_template, tokenizer, "record 1")
    marked = family_tokenizer(family, TRL_TEMPLATES / training)
    reference = render_chat(chat, marked.chat_template, marked, "record 1")  # its {% generation %} marks
    assert reference[0] == ids  # the same text, token for token
    assert not any(mine and not theirs for mine, theirs in zip(ours, reference[1]))  # nothing more than trl
    extra = trained_runs(ids, [t if theirs and not mine else -100 for t, mine, theirs in zip(ids, ours, reference[1])],
                         tokenizer)  # fmt: skip
    assert extra and all(run.strip("\n") in ("", header) for run in extra), extra


def test_a_template_that_never_mentions_tools_refuses_a_record_with_tool_turns():
    """Phi-4's template renders no tool call or result: those turns would vanish, and the rest train alone."""
    phi = Family("phi-4", TESTS / "phi-4.jinja", None, "<|im_end|>", ("<|im_start|>", "<|im_sep|>", "<|im_end|>"), ())
    tokenizer = family_tokenizer(phi)
    with pytest.raises(DataError, match="record 1: the record has tool calls or tool results, .* renders neither"):
        render_chat(normalize_record(RECORD, "messages", "record 1"), tokenizer.chat_template, tokenizer, "record 1")
    ids, _ = render_chat(normalize_record(WITHOUT_TOOLS, "messages", "record 1"), tokenizer.chat_template, tokenizer,
                         "record 1")  # fmt: skip
    assert ids


def test_glm_masks_are_trls_on_its_training_template_token_for_token():
    """Where trl's training template marks GLM's stop tokens (the next turn's opener), ours trains them too."""
    family = next(f for f in FAMILIES if f.name == "glm-4-moe")
    tokenizer = family_tokenizer(family)
    chat = normalize_record(RECORD, "messages", "record 1")
    ids, ours = render_chat(chat, tokenizer.chat_template, tokenizer, "record 1")
    marked = family_tokenizer(family, TRL_TEMPLATES / "glm4moe_training.jinja")
    assert render_chat(chat, marked.chat_template, marked, "record 1") == (ids, ours)


@pytest.mark.parametrize("reasoning", ["template", "every_turn", "none"])
def test_a_template_that_renders_no_reasoning_is_named_with_the_records_it_costs(tmp_path, reasoning):
    """The R1 distills' template cuts the reasoning from every turn: training says how many records lose theirs
    (no mode trains it), and stays silent for a template that keeps it, or when no reasoning is asked for."""
    by_name = {family.name: family for family in FAMILIES}
    plain = {"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "Hello."}]}
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [WITHOUT_TOOLS, plain, WITHOUT_TOOLS]))
    for name, template, expected in [
        ("deepseek-r1-distill", None, reasoning != "none"),
        ("deepseek-r1-distill", TRL_TEMPLATES / "deepseek_r1_distill_training.jinja", False),
        ("qwen3", None, False),
    ]:
        config = DataConfig(train=[str(tmp_path / "chat.jsonl")], format="chat", reasoning=reasoning)
        lines: list[str] = []
        cache = tmp_path / f"cache-{name}-{template is None}"
        build_datasets(config, family_tokenizer(by_name[name], template), cache_dir=cache, log=lines.append)
        said = [line for line in lines if "renders no assistant reasoning" in line]
        assert len(said) == expected, (name, template, lines)
        assert all("the reasoning of 2 of 3 records is not trained" in line for line in said), said


def test_every_turn_trains_each_turns_reasoning_once_and_none_trains_none(tmp_path, capsys):
    qwen3 = FAMILIES[0]
    tokenizer = family_tokenizer(qwen3)
    more = [{"role": "user", "content": "And Rome?"}, {"role": "assistant", "reasoning_content": "Call again.",
                                                      "content": "Rome: 25 C."}]  # fmt: skip
    record = {"tools": TOOLS, "messages": [*MESSAGES, *more]}
    (document,) = preview_json(tmp_path, tokenizer, record, capsys)
    # As rendered: Qwen3 drops the reasoning of the turns before the last user message.
    assert trained_runs(document["input_ids"], document["labels"], tokenizer) == [
        QWEN_CALL,
        "Paris: 18 C and sunny.<|im_end|>",
        "<think>\nCall again.\n</think>\n\nRome: 25 C.<|im_end|>",
    ]
    documents = preview_json(tmp_path, tokenizer, record, capsys, "data.reasoning=every_turn")
    assert [trained_runs(d["input_ids"], d["labels"], tokenizer) for d in documents] == [
        ["<think>\nI should call the tool.\n</think>\n\n" + QWEN_CALL], [ANSWER_WITH_THINKING + "<|im_end|>"],
        ["<think>\nCall again.\n</think>\n\nRome: 25 C.<|im_end|>"]]  # fmt: skip
    assert {d["record"] for d in documents} == {1}

    # Short of room for the later turns, their documents are dropped: training says how many, as preview shows
    first_length = len(documents[0]["input_ids"])
    lines: list[str] = []
    config = DataConfig(train=[str(tmp_path / "chat.jsonl")], format="chat", reasoning="every_turn",
                        max_seq_len=first_length + 2)  # fmt: skip
    build_datasets(config, tokenizer, cache_dir=tmp_path / "cache", log=lines.append)
    assert any("data: 2 documents of kept records had nothing left to train on" in line for line in lines), lines
    (plain,) = preview_json(tmp_path, tokenizer, record, capsys, "data.reasoning=none")
    runs = trained_runs(plain["input_ids"], plain["labels"], tokenizer)
    assert runs == [QWEN_CALL, "Paris: 18 C and sunny.<|im_end|>", "Rome: 25 C.<|im_end|>"]
    # with thinking off, Qwen3's generation prompt holds the empty think block: context, not trained
    assert tokenizer.decode(plain["input_ids"]).endswith("<think>\n\n</think>\n\nRome: 25 C.<|im_end|>\n")


def _sharegpt(record: dict) -> dict:
    turns = [{"from": "system", "value": SYSTEM}, {"from": "human", "value": QUESTION},
             {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
             {"from": "observation", "value": RESULT}, {"from": "gpt", "value": "Paris: 18 C and sunny."}]  # fmt: skip
    return {"tools": json.dumps(TOOLS), "conversations": turns}


def _variant(change) -> dict:
    record = copy.deepcopy(RECORD)
    change(record["messages"])
    return record


SHAPES = {
    "arguments as an object": lambda m: m[2]["tool_calls"][0]["function"].update(arguments={"city": "Paris"}),
    "content empty, not null": lambda m: m[2].update(content=""),
    "reasoning as thinking": lambda m: [m[i].update(thinking=m[i].pop("reasoning_content")) for i in (2, 4)],
    "reasoning inline": lambda m: m[4].update(
        content="<think>\nIt is mild.\n</think>\n\n" + m[4]["content"], reasoning_content=None
    ),
    "ipython result": lambda m: m[3].update(role="ipython"),
}


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.record is None], ids=lambda f: f.name)
def test_the_shapes_people_have_render_the_same_tokens(family):
    tokenizer = family_tokenizer(family)

    def rendered(record: dict) -> tuple[list[int], list[bool]]:
        chat = normalize_record(record, "messages", "record 1")
        return render_chat(chat, tokenizer.chat_template, tokenizer, "record 1")

    reference = rendered(RECORD)
    for name, change in SHAPES.items():
        assert rendered(_variant(change)) == reference, name
    # ShareGPT: function_call and observation turns, tools as JSON text; no reasoning and no call id, so
    # compared with the OpenAI record without them
    bare = _variant(lambda m: [m[2].pop("reasoning_content"), m[4].pop("reasoning_content")])
    if family.name != "mistral-v0.3":  # its template requires 9-character call ids, which ShareGPT lacks
        bare["messages"][2]["tool_calls"][0].pop("id")
        bare["messages"][3].pop("tool_call_id")
        assert rendered(_sharegpt(RECORD)) == rendered(bare)


BAD_RECORDS = [
    ("a result with no call", lambda m: m.pop(2), r"messages\[2\] is a tool result with no tool call before it"),
    ("a call to an unknown tool", lambda m: m[2]["tool_calls"][0]["function"].update(name="get_time"),
     r"messages\[2\] calls 'get_time', which is not in the record's tools \(get_weather\)"),
    ("malformed arguments", lambda m: m[2]["tool_calls"][0]["function"].update(arguments='{"city": Paris}'),
     r"messages\[2\]\.tool_calls\[0\]: the arguments of 'get_weather' are not valid JSON"),
    ("a result for another call", lambda m: m[3].update(tool_call_id="call00002"),
     r"messages\[3\] answers tool_call_id 'call00002'"),
    ("a null reply with no call", lambda m: m[4].update(content=None),
     r"messages\[4\]\.content is None on an assistant turn that calls no tools"),
    ("a missing reply", lambda m: m[4].pop("content"),
     r"messages\[4\]\.content is missing on an assistant turn that calls no tools"),
    ("a blank reply", lambda m: [m[4].pop("reasoning_content"), m[4].update(content=" \n")],
     r"messages\[4\]\.content is empty on an assistant turn that calls no tools"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "change", "message"), BAD_RECORDS, ids=[b[0] for b in BAD_RECORDS])
def test_a_bad_tool_record_is_one_line_naming_the_record(name, change, message, tmp_path, capsys):
    tokenizer = family_tokenizer(FAMILIES[0])
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    (tmp_path / "chat.jsonl").write_text(json.dumps(RECORD) + "\n" + json.dumps(_variant(change)) + "\n")
    recipe = {"model": {"base": "embedded:tiny-llama", "tokenizer": str(tmp_path / "tokenizer")},
              "data": {"train": str(tmp_path / "chat.jsonl"), "format": "chat"}, "output": {"name": "x"}}  # fmt: skip
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    assert main(["data", "preview", str(tmp_path / "recipe.yaml"), "--limit", "2"]) == 2
    (error,) = capsys.readouterr().err.strip().splitlines()
    assert "record 2" in error
    with pytest.raises(DataError, match=message):
        normalize_record(_variant(change), "messages", "record 2")


def test_a_tool_without_a_field_the_template_reads_is_named_with_the_fix():
    """gpt-oss's template reads every tool's `description`: the error names the tool and says to add it."""
    gpt_oss = FAMILIES[4]
    tokenizer = family_tokenizer(gpt_oss)
    bare = [{"type": "function", "function": {k: v for k, v in TOOLS[0]["function"].items() if k != "description"}}]
    record = normalize_record({"tools": bare, "messages": MESSAGES}, "messages", "record 1")
    expected = "record 1: .*tool 'get_weather' has no 'description', which this template reads: add it to the tool$"
    with pytest.raises(DataError, match=expected):
        render_chat(record, tokenizer.chat_template, tokenizer, "record 1")


def test_dpo_pairs_and_grpo_prompts_take_the_same_chat_records(tmp_path):
    gpt_oss = FAMILIES[4]
    tokenizer = family_tokenizer(gpt_oss)
    pair = {"tools": TOOLS, "prompt": MESSAGES[:4], "chosen": [MESSAGES[4]],
            "rejected": [{"role": "assistant", "thinking": "Guess.", "content": "Paris: 30 C."}]}  # fmt: skip
    (tmp_path / "pairs.jsonl").write_text(json.dumps(pair) + "\n")
    config = DataConfig(train=[str(tmp_path / "pairs.jsonl")], format="preference", max_seq_len=2048)
    ((_, row),) = preview_records(config, tokenizer, limit=1)
    chosen = trained_runs(row["chosen_input_ids"], row["chosen_labels"], tokenizer)
    rejected = trained_runs(row["rejected_input_ids"], row["rejected_labels"], tokenizer)
    assert chosen == [gpt_oss.trained[1]]  # the prompt's tool call is context
    assert rejected == ["<|channel|>analysis<|message|>Guess.<|end|><|start|>assistant<|channel|>final<|message|>"
                        "Paris: 30 C.<|return|>"]  # fmt: skip
    prompt = encode_chat_prompt(MESSAGES[:4], config, tokenizer, "record 1", tools=TOOLS)
    assert tokenizer.decode(prompt).endswith(f'"{RESULT}"<|end|><|start|>assistant')
    # gpt-oss shows a pending call's analysis at inference and drops it once a final answer follows: the
    # prompt is not a prefix of the pair's rendering, and the turns are still located in the latter
    assert "I should call the tool." in tokenizer.decode(prompt)
    assert "I should call the tool." not in tokenizer.decode(row["chosen_input_ids"])
    with pytest.raises(DataError, match=r"record 1: prompt\[2\] calls 'get_weather', which is not in"):
        encode_chat_prompt(MESSAGES[:4], config, tokenizer, "record 1", tools=[{"name": "other"}])


def test_chat_record_normalises_to_what_each_template_reads():
    chat = normalize_record(_sharegpt(RECORD), "messages", "record 1")
    assert chat == ChatRecord(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
         {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
             "name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "content": RESULT}, {"role": "assistant", "content": "Paris: 18 C and sunny."}],
        TOOLS,
    )  # fmt: skip


def test_gpt_oss_takes_a_tool_call_turn_with_both_text_and_reasoning_as_one_analysis(tmp_path, capsys):
    """gpt-oss's template refuses a tool-call turn with both content and thinking ("Put the analysis
    message in one or the other"): both are given to it as one analysis message."""
    gpt_oss = FAMILIES[4]
    tokenizer = family_tokenizer(gpt_oss)
    record = _variant(lambda m: m[2].update(content="Let me check."))
    first, _ = preview_json(tmp_path, tokenizer, record, capsys, "data.reasoning=every_turn")
    assert trained_runs(first["input_ids"], first["labels"], tokenizer) == [
        "<|channel|>analysis<|message|>I should call the tool.\n\nLet me check.<|end|><|start|>assistant"
        + gpt_oss.trained[0]
    ]


def test_the_data_cache_tells_reasoning_and_tools_field_apart(tmp_path):
    from finetune.data.cache import data_fingerprint

    tokenizer = family_tokenizer(FAMILIES[0])
    (tmp_path / "chat.jsonl").write_text(json.dumps(RECORD) + "\n")

    def fingerprint(**fields) -> str:
        return data_fingerprint(DataConfig(train=[str(tmp_path / "chat.jsonl")], **fields), tokenizer, seed=0)

    chat = fingerprint(format="chat")
    assert len({chat, fingerprint(format="chat", reasoning="none"), fingerprint(format="chat", tools_field="t")}) == 3
    assert fingerprint(format="text") == fingerprint(format="text", reasoning="every_turn")  # text has no reasoning


@pytest.mark.parametrize("family", FAMILIES[:5], ids=[f.name for f in FAMILIES[:5]])
def test_an_assistant_turn_of_reasoning_alone_trains_its_closing_token(family):
    """A turn with reasoning and no answer renders empty where a template drops earlier turns' reasoning: it is
    located where its content would go, so its closing token is trained. (With no reasoning either, an empty turn
    is refused: tests above.)"""
    tokenizer = family_tokenizer(family)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "reasoning_content": "Hm."},
                {"role": "user", "content": "Again"}, {"role": "assistant", "content": "Yes."}]  # fmt: skip
    ids, trained = render_chat(normalize_record({"messages": messages}, "messages", "r"), family.template.read_text(),
                               tokenizer, "r")  # fmt: skip
    runs = trained_runs(ids, [token if keep else -100 for token, keep in zip(ids, trained)], tokenizer)
    closing = {"<|im_end|>": "<|im_end|>", "<|eot_id|>": "<|eot_id|>", "<|return|>": "<|end|>"}[family.eos]
    assert runs[0].endswith(closing) and "Hi" not in runs[0] and len(runs) == 2


SECOND_CALL = {
    "id": "call00002",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
}
DROPPED_CALLS = [
    # gpt-oss's template renders a turn's first call only: the second would vanish, its result answering nothing
    ("gpt-oss", lambda m: [m[2].update(tool_calls=[CALL, SECOND_CALL]), m.insert(4, {**m[3], "tool_call_id": "call00002"})],
     r"messages\[2\]: the chat template does not render tool_calls\[1\] \(get_weather\) of this turn's 2"),
    # the R1 distills' renders calls only on a turn without text: the turn would train as text and a stop
    ("deepseek-r1-distill-tools", lambda m: m[2].update(content="Let me look that up."),
     r"messages\[2\]: the chat template does not render tool_calls\[0\] \(get_weather\) of this turn's 1"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "change", "message"), DROPPED_CALLS, ids=[d[0] for d in DROPPED_CALLS])
def test_a_tool_call_the_template_drops_is_one_line_naming_the_turn(name, change, message, tmp_path, capsys):
    family = next(f for f in FAMILIES if f.name == name)
    tokenizer = family_tokenizer(family)
    record = _variant(change)
    with pytest.raises(DataError, match="record 1: " + message):
        render_chat(normalize_record(record, "messages", "record 1"), tokenizer.chat_template, tokenizer, "record 1")
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    (tmp_path / "chat.jsonl").write_text(json.dumps(record) + "\n")
    recipe = {"model": {"base": "embedded:tiny-llama", "tokenizer": str(tmp_path / "tokenizer")},
              "data": {"train": str(tmp_path / "chat.jsonl"), "format": "chat"}, "output": {"name": "x"}}  # fmt: skip
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    assert main(["data", "preview", str(tmp_path / "recipe.yaml")]) == 2
    (error,) = capsys.readouterr().err.strip().splitlines()
    assert "line 1 (record 1): messages[2]: the chat template does not render tool_calls" in error


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.record is None], ids=lambda f: f.name)
def test_a_short_tool_result_that_shows_inside_the_call_leaves_the_call_trained_through_its_end(family):
    """A result such as `1` shows in Mistral's call id (`call00001`) and `}` in every call's JSON, between the
    call's arguments and its closing token: it is not where the result starts, and the call stays trained whole."""
    tokenizer = family_tokenizer(family)
    for result in ("1", "}"):
        chat = normalize_record(_variant(lambda m, r=result: m[3].update(content=r)), "messages", "record 1")
        ids, trained = render_chat(chat, tokenizer.chat_template, tokenizer, "record 1")
        runs = trained_runs(ids, [token if keep else -100 for token, keep in zip(ids, trained)], tokenizer)
        assert runs == list(family.trained), result


def test_a_turn_after_a_tool_result_with_no_header_trains_its_wrapping_from_the_results_end():
    """Mistral's template writes no generation prompt after `[/TOOL_RESULTS]`: a second call is trained from there
    (`[TOOL_CALLS] [{"name": ...`, what the model writes), not from its arguments. With a later user turn the
    template moves the tools before that turn, so the conversation before the call is no prefix of the rendering:
    the call still starts after the token that closes the result."""
    mistral = next(f for f in FAMILIES if f.name == "mistral-v0.3")
    tokenizer = family_tokenizer(mistral)
    rome = {"id": "call00002", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
    calls = [{"role": "assistant", "content": None, "tool_calls": [rome]},
             {"role": "tool", "tool_call_id": "call00002", "content": "25 C"}]  # fmt: skip
    later = [{"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "You are welcome."}]
    call = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}, "id": "call00002"}]</s>'
    for after in ([], later):
        record = {"tools": TOOLS, "messages": [*MESSAGES[:4], *calls, MESSAGES[4], *after]}
        chat = normalize_record(record, "messages", "record 1")
        ids, trained = render_chat(chat, tokenizer.chat_template, tokenizer, "record 1")
        runs = trained_runs(ids, [token if keep else -100 for token, keep in zip(ids, trained)], tokenizer)
        assert runs[:3] == [mistral.trained[0], call, mistral.trained[1]], after
        assert runs[3:] == ([" You are welcome.</s>"] if after else [])


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.record is None or f.name == "deepseek-v3"],
                         ids=lambda f: f.name)  # fmt: skip
def test_a_tool_that_returned_nothing_leaves_the_turns_trained_as_with_a_result(family):
    """A tool's result may be empty (null, "" or blanks): it shows nowhere in the rendering, which is no sign that
    the template renders text depending on the assistant's words; the turns train as with any result."""
    tokenizer = family_tokenizer(family)
    for result in (None, "", "  "):
        record = _variant(lambda m, r=result: m[3].update(content=r))
        record["tools"] = (family.record or RECORD)["tools"]
        ids, trained = render_chat(normalize_record(record, "messages", "record 1"), tokenizer.chat_template,
                                   tokenizer, "record 1")  # fmt: skip
        runs = trained_runs(ids, [token if keep else -100 for token, keep in zip(ids, trained)], tokenizer)
        assert runs == list(family.trained), result


HEADERLESS_ANSWER = {"mistral-v0.3": " Paris: 18 C.</s>", "deepseek-v3": "Paris: 18 C.<｜end▁of▁sentence｜>"}


@pytest.mark.parametrize("name", list(HEADERLESS_ANSWER))
def test_an_answer_after_context_tool_results_trains_alone(name, tmp_path, capsys):
    """Mistral's and DeepSeek's templates write no generation prompt after tool results. With the turns before it
    as context (an `every_turn` document, a preference pair's prompt), the answer's start is looked for after
    them, not at the call turn's header: that would train the call and the tool result as the answer (or stop the
    run, when the result's text shows nowhere else)."""
    family = next(f for f in FAMILIES if f.name == name)
    tokenizer = family_tokenizer(family)
    prompt = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call00001", "content": "Paris"}]  # fmt: skip
    answer = {"role": "assistant", "content": "Paris: 18 C."}
    for result in ("Paris", RESULT):  # shown in the question too, and only as the result
        prompt[2]["content"] = result
        _, second = preview_json(tmp_path, tokenizer, {"tools": TOOLS, "messages": [*prompt, answer]}, capsys,
                                 "data.reasoning=every_turn")  # fmt: skip
        assert trained_runs(second["input_ids"], second["labels"], tokenizer) == [HEADERLESS_ANSWER[name]], result
    pair = {"tools": TOOLS, "prompt": prompt, "chosen": [answer], "rejected": [{**answer, "content": "Paris: 30 C."}]}
    (tmp_path / "pairs.jsonl").write_text(json.dumps(pair) + "\n")
    config = DataConfig(train=[str(tmp_path / "pairs.jsonl")], format="preference", max_seq_len=2048)
    ((_, row),) = preview_records(config, tokenizer, limit=1)
    assert trained_runs(row["chosen_input_ids"], row["chosen_labels"], tokenizer) == [HEADERLESS_ANSWER[name]]


def test_a_marked_template_trains_no_turn_of_the_prompt_where_the_prompt_is_no_prefix(tmp_path, capsys):
    """With trl's `{% generation %}`-marked gpt-oss template, a pair's prompt (or an `every_turn` document's context)
    renders the pending call's analysis, which the whole conversation drops: the prompt is no prefix of it, and
    its tool call, marked like any assistant turn, must still stay context."""
    gpt_oss = FAMILIES[4]
    tokenizer = family_tokenizer(gpt_oss, TRL_TEMPLATES / "gptoss_training.jinja")
    answer = "<|start|>assistant" + gpt_oss.trained[1]  # trl's marks take the header with the turn
    pair = {"tools": TOOLS, "prompt": MESSAGES[:4], "chosen": [MESSAGES[4]],
            "rejected": [{"role": "assistant", "thinking": "Guess.", "content": "Paris: 30 C."}]}  # fmt: skip
    (tmp_path / "pairs.jsonl").write_text(json.dumps(pair) + "\n")
    config = DataConfig(train=[str(tmp_path / "pairs.jsonl")], format="preference", max_seq_len=2048)
    ((_, row),) = preview_records(config, tokenizer, limit=1)
    assert trained_runs(row["chosen_input_ids"], row["chosen_labels"], tokenizer) == [answer]
    _, second = preview_json(tmp_path, tokenizer, RECORD, capsys, "data.reasoning=every_turn")
    assert trained_runs(second["input_ids"], second["labels"], tokenizer) == [answer]


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.name != "mistral-v0.3"], ids=lambda f: f.name)
def test_a_developer_message_is_the_system_message_where_the_template_has_no_developer_role(family):
    """OpenAI's `developer` role stands for the system message; Qwen's, DeepSeek's and GLM's templates render no
    message of a role they do not know, so its instructions would vanish from every example without a word."""
    tokenizer = family_tokenizer(family)

    def rendered(role: str) -> tuple[list[int], list[bool]]:
        messages = [{"role": role, "content": SYSTEM}, *WITHOUT_TOOLS["messages"][1:]]
        chat = normalize_record({"messages": messages}, "messages", "record 1")
        return render_chat(chat, tokenizer.chat_template, tokenizer, "record 1")

    ids, trained = rendered("developer")
    assert SYSTEM in tokenizer.decode(ids)
    assert all(SYSTEM not in run for run in trained_runs(ids, [t if k else -100 for t, k in zip(ids, trained)],
                                                         tokenizer))  # fmt: skip
    if family.name != "gpt-oss":  # gpt-oss's has a developer message of its own
        assert (ids, trained) == rendered("system")
