"""Cost of finding assistant turns in a chat rendering: milliseconds per record, three ways.

Not a test. On one tool-calling conversation with reasoning (system, user, a tool call, its result, an
answer, a second question and answer: three assistant turns), with a small byte-level BPE tokenizer
carrying Qwen2.5's special tokens:
- **located**: `render_chat` with the original Qwen2.5 template (trl's `qwen2_5.jinja`): one rendering,
  one more per assistant turn with its words replaced by sentinels, then the offsets tokenization;
- **marked**: `render_chat` with trl's `qwen2_5_training.jinja` (`{% generation %}` marks: transformers'
  `return_assistant_tokens_mask`);
- **no mask**: `apply_chat_template(..., tokenize=True)` alone (what `completion_only_loss=false` costs).

Each figure is the median over `--repeats` rounds of `--records` records, one process, one thread; the
load average is printed beside it, since this machine is shared.

    python bench/chat_masks.py                       # about 10 s
    python bench/chat_masks.py --records 400 --repeats 7
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from finetune.data.chat import normalize_record
from finetune.data.chat_turns import apply_template, render_chat

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
RECORD = {
    "tools": TOOLS,
    "messages": [
        {"role": "system", "content": "You report the weather."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "I should call the tool.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C, sunny"},
        {"role": "assistant", "content": "Paris: 18 C and sunny."},
        {"role": "user", "content": "Umbrella?"},
        {"role": "assistant", "content": "No need today: it stays dry until tomorrow evening."},
    ],
}  # fmt: skip


def tokenizer_with(template: Path) -> PreTrainedTokenizerFast:
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    backend.train_from_iterator([json.dumps(RECORD)] * 10, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                        additional_special_tokens=specials)  # fmt: skip
    tokenizer.chat_template = template.read_text()
    return tokenizer


def per_record_ms(work, records: int, repeats: int) -> float:
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(records):
            work()
        rounds.append((time.perf_counter() - start) / records * 1e3)
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    spec = importlib.util.find_spec("trl")
    assert spec is not None and spec.origin, "trl (the test extra) ships the templates"
    templates = Path(spec.origin).parent / "chat_templates"
    chat = normalize_record(RECORD, "messages", "record 1")
    original, marked = tokenizer_with(templates / "qwen2_5.jinja"), tokenizer_with(templates / "qwen2_5_training.jinja")
    arms = {
        "located": lambda: render_chat(chat, original.chat_template, original, "record 1"),
        "marked": lambda: render_chat(chat, marked.chat_template, marked, "record 1"),
        "no mask": lambda: apply_template(original, chat, original.chat_template, "record 1", tokenize=True),
    }
    for arm in arms.values():
        arm()  # warm: template compilation, the probe of the template's header and closing tokens
    for name, arm in arms.items():
        ms = per_record_ms(arm, args.records, args.repeats)
        print(f"{name:8s} {ms:6.2f} ms per record (3 assistant turns), load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
