"""Plain functions and constants shared by the test modules (fixtures live in conftest.py and *_fixtures.py).

One place for what several test files need, so that no test module imports another: the tiny model's
shape and tokenizer corpus, instruction records, seeded peft adapters, tensor comparisons, and greedy
decoding computed by hand as the reference for every `generate` test.

Example:
    from helpers import make_adapter, greedy_ids
    make_adapter(tiny_base_dir, tmp_path / "legal", seed=1, targets=("q_proj", "v_proj"))
"""

from __future__ import annotations

import math
import os
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
    base_dtype: str | None = None,
    **lora_options,
) -> Path:
    """A peft LoRA adapter for `base_dir` with seeded random A, B (so ΔW ≠ 0), optionally with a manifest
    (recording `quantization` and the dtype its run loaded the base in, `base_dtype`)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.fingerprint import fingerprint_model_dir
    from finetune.manifest import BaseInfo, Manifest, write_manifest

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora_options.setdefault("target_modules", list(targets))  # or a regex of the test's own
    config = LoraConfig(r=r, lora_alpha=alpha, use_rslora=use_rslora, lora_dropout=0.0, **lora_options)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter_name, parameter in peft_model.named_parameters():
            if "lora_" in parameter_name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * magnitude)
    peft_model.save_pretrained(out)
    if manifest:
        base = BaseInfo(
            id=str(base_dir), path=str(base_dir), fingerprint=fingerprint_model_dir(base_dir), quantization=quantization,
            dtype=base_dtype,
        )  # fmt: skip
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


# Tolerances in units in the last place (ulps) of the magnitude compared, each named for why results differ.
# Summation order differs between CPU kinds (AMX, AVX-512 without AMX, AVX2 only: each has its own matmul
# and reduction kernels), between packed and padded layouts, and between one micro-batch and several, so
# float32 results that are the same sum in another order agree to a few tens of ulps, never bit for bit.
# Figures observed on an Intel Xeon with AVX-512 and no AMX are beside the tests that use them; to measure
# another CPU, run the tests with FINETUNE_TEST_ULPS_LOG=file: each comparison appends its ulps there.
ULPS_LOG_ENV = "FINETUNE_TEST_ULPS_LOG"
REORDERED_ULPS = 64  # the same float32 sums in another order: layouts, micro-batches, CPU kernels, W + ΔW merged
LIBRARY_ULPS = 512  # the same maths written by another library (trl, peft): other op order (90 seen vs trl)
SUM_ULPS = 4  # a loss or reward from float32 sums of log-probabilities, in ulps of the largest sum (0.7 seen)
ROUNDED_ULPS = 4  # one or two roundings apart (x·(1/(1-p)) against x/(1-p), one B·A product)
PRINTED_3E = 5e-4 + 1e-6  # relative: a figure printed with `:.3e` (4 significant digits) against the float


def ulp(x: float | torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """One unit in the last place of `dtype` at the magnitude |x| (a tensor: its largest |element|).

    The spacing of `dtype`'s numbers just above |x|: 2^(exponent of x) * eps. At 131.3 in float32 that is
    2^7 * 2^-23 = 1.5e-5; at 6.2 it is 4.8e-7. Below `dtype`'s smallest normal it is the subnormal spacing.
    """
    magnitude = float(x.detach().abs().max()) if isinstance(x, torch.Tensor) else abs(float(x))
    info = torch.finfo(dtype)
    if magnitude < info.tiny:
        return info.tiny * info.eps
    _, exponent = math.frexp(magnitude)  # magnitude = m * 2**exponent with 0.5 <= m < 1
    return math.ldexp(info.eps, exponent - 1)


def assert_within_ulps(
    actual: float | torch.Tensor,
    expected: float | torch.Tensor,
    ulps: float,
    *,
    dtype: torch.dtype = torch.float32,
    scale: float | torch.Tensor | None = None,
    what: str = "",
) -> None:
    """`actual` equals `expected` to within `ulps` units in the last place of `dtype` at `scale`.

    `scale` is the magnitude rounding happens at: by default the largest |expected|, so every element of a
    tensor (a gradient's small entries too) is held to the precision its largest entry is computed with;
    pass the size of the terms of a sum whose result cancels (a loss difference) so the tolerance is not
    set by a small result. The message gives the largest difference in ulps, which is what to quote when a
    tolerance is chosen.
    """
    actual_t = torch.as_tensor(actual, dtype=torch.float64)
    expected_t = torch.as_tensor(expected, dtype=torch.float64)
    assert actual_t.shape == expected_t.shape, f"{what} shape {tuple(actual_t.shape)} != {tuple(expected_t.shape)}"
    unit = ulp(expected_t if scale is None else scale, dtype)
    assert torch.isfinite(actual_t).all() and torch.isfinite(expected_t).all(), f"{what} not finite"
    difference = (actual_t - expected_t).abs().max().item() if actual_t.numel() else 0.0
    if os.environ.get(ULPS_LOG_ENV):  # to measure a CPU kind: every comparison's ulps, by test
        with open(os.environ[ULPS_LOG_ENV], "a") as log:
            log.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}\t{what}\t{difference / unit:.2f}\t{ulps}\n")
    assert difference <= ulps * unit, (
        f"{what} differs by {difference:.3e} = {difference / unit:.1f} ulps of {dtype} at "
        f"{unit / torch.finfo(dtype).eps:.3g} (allowed {ulps})"
    )


def assert_tensors_within_ulps(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], ulps: float, *, what: str = ""
) -> None:
    """The same names, and each tensor within `ulps` of its own largest entry (`assert_within_ulps`)."""
    assert actual.keys() == expected.keys() and expected, f"{what}: {sorted(actual)} != {sorted(expected)}"
    for name, tensor in expected.items():
        assert_within_ulps(actual[name], tensor, ulps, what=f"{what} {name}".strip())


def ulps_apart(
    actual: float | torch.Tensor, expected: float | torch.Tensor, dtype: torch.dtype = torch.float32
) -> float:
    """The largest difference of `actual` from `expected` in ulps of `dtype` at |expected|'s largest entry."""
    actual_t, expected_t = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return (actual_t - expected_t).abs().max().item() / ulp(expected_t, dtype)


def bnb_weight(layer: torch.nn.Module) -> torch.Tensor:
    """The fp32 weight a bitsandbytes layer computes with, by bitsandbytes' own definitions, not finetune's:
    4-bit through `dequantize_4bit` and its quant state; 8-bit as int8 rows times their absmax / 127."""
    import bitsandbytes as bnb

    if isinstance(layer, bnb.nn.Linear4bit):
        return bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
    scales = getattr(layer.weight, "SCB", None)
    scales = layer.state.SCB if scales is None else scales
    return layer.weight.data.float() * scales.float()[:, None] / 127


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


FAMILY_SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip


def tiny_model(family: str, **config):
    """A random tiny causal LM of `family` (grouped-query attention: 4 query heads, 2 key/value heads)."""
    import transformers

    config_class, model_class = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    }[family]
    torch.manual_seed(0)
    settings = {**FAMILY_SHAPE, **config}
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**settings))
    return model.eval()


def with_adapter(model, **lora):
    """`model` with a LoRA on every linear layer of its blocks, B drawn as if trained (not zero)."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **lora))
    for name, parameter in peft_model.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_(0, 0.05)
    return peft_model.eval()
