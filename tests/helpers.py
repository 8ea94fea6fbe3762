"""Plain functions and constants shared by the test modules (fixtures live in conftest.py and *_fixtures.py).

One place for what several test files need, so that no test module imports another: the tiny model's
shape and tokenizer corpus, instruction records, seeded peft adapters, tensor comparisons, and greedy
decoding computed by hand as the reference for every `generate` test.

Example:
    from helpers import make_adapter, greedy_ids
    make_adapter(tiny_base_dir, tmp_path / "legal", seed=1, targets=("q_proj", "v_proj"))
"""

from __future__ import annotations

from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

# Small enough that a training step takes milliseconds; every linear out_features is a multiple of 32.
TEST_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tokenizer_corpus() -> list[str]:
    """The text the tiny test tokenizer is trained on: rotated sentences about adapters, and a little code."""
    words = (
        "the model reads a document and predicts the next token while the adapter learns a low rank "
        "update of the frozen weight matrix for the domain in question with loss on response tokens"
    ).split()
    lines = [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    code = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i * 2)\n"]
    return (lines + code) * 20


def instruction_records(count: int) -> list[dict]:
    """`count` instruction records about coloured crates (some with an input), deterministic."""
    colours = ["red", "green", "blue", "amber", "violet", "teal", "ochre"]
    records = []
    for i in range(count):
        colour = colours[i % len(colours)]
        records.append(
            {
                "instruction": f"What colour is crate {i}?",
                "input": "" if i % 3 else f"warehouse {i % 5}",
                "output": f"Crate {i} is {colour}, shelf {i % 4}.",
            }
        )
    return records


_COLOURS = ("red", "green", "blue", "amber", "violet", "teal", "ochre")


def preference_records(count: int) -> list[dict[str, str]]:
    """Pairs about crates: the chosen answer names the crate's colour, the rejected one another colour."""
    pairs = []
    for i, record in enumerate(instruction_records(count)):
        right, wrong = _COLOURS[i % 7], _COLOURS[(i + 3) % 7]
        prompt = f"### Instruction:\n{record['instruction']}\n\n### Response:\n"
        pairs.append({"prompt": prompt, "chosen": record["output"], "rejected": record["output"].replace(right, wrong)})
    return pairs


def make_adapter(
    base_dir: Path,
    out: Path,
    *,
    seed: int,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    r: int = 4,
    alpha: float = 8,
    use_rslora: bool = False,
    manifest: bool = True,
    name: str | None = None,
    magnitude: float = 0.2,
    quantization: str = "none",
    **lora_options,
) -> Path:
    """A peft LoRA adapter for `base_dir` with seeded random A, B (so ΔW ≠ 0), optionally with a manifest."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.fingerprint import fingerprint_model_dir
    from finetune.manifest import BaseInfo, Manifest, write_manifest

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora, lora_dropout=0.0, **lora_options
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter_name, parameter in peft_model.named_parameters():
            if "lora_" in parameter_name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * magnitude)
    peft_model.save_pretrained(out)
    if manifest:
        base = BaseInfo(
            id=str(base_dir), path=str(base_dir), fingerprint=fingerprint_model_dir(base_dir), quantization=quantization
        )
        write_manifest(out, Manifest(name=name or out.name, base=base))
    return out


def base_tensors(model) -> dict[str, torch.Tensor]:
    """A detached copy of every tensor in a model's state dict."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_tensors_equal(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    """Bit-for-bit equality of two state dicts, naming the first tensor that differs."""
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), (
            f"{name} differs: max |Δ| {(expected[name].float() - actual[name].float()).abs().max():.3e}"
        )


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every `*.safetensors` file in `model_dir` (shards merged), by name."""
    from safetensors import safe_open

    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def greedy_ids(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """Greedy decoding by hand: a full forward pass over the whole sequence per new token, then argmax.

    No KV cache, no `generate`, no logits processors: the reference `generate` is compared with. Stops
    after `eos_token_id` (kept, as `generate` keeps it) or `max_new_tokens`.
    """
    assert not model.training, "put the model in eval mode (dropout would make the reference random)"
    ids = list(prompt_ids)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits  # (1, T, vocab)
            token = int(logits[0, -1].argmax())
            ids.append(token)
            new.append(token)
            if token == eos_token_id:
                break
    return new


def greedy_text(
    base_dir: Path, adapter_dir: Path | str | None, prompt: str, max_new_tokens: int, *, chat: bool = False
) -> str:
    """What `finetune generate` must print for `prompt` (without its newline): `greedy_ids` on the base
    loaded by transformers with the adapter loaded by peft (none: the base alone), decoded without specials.
    The prompt is tokenized as the tokenizer does (BOS first), or with `chat` as one user turn of its template."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    if chat:
        messages = [{"role": "user", "content": prompt}]
        prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    else:
        prompt_ids = tokenizer(prompt)["input_ids"]
    ids = greedy_ids(model.eval(), prompt_ids, max_new_tokens, tokenizer.eos_token_id)
    return tokenizer.decode(ids, skip_special_tokens=True)
