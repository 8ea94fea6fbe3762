"""The lean decode step (`finetune.generation.lean_decoder`): the model's own logits over a left-padded batch
with a KV cache for each Llama-family architecture it takes, and the model's forward kept for what it declines."""

from __future__ import annotations

import pytest
import torch
from helpers import REORDERED_ULPS, assert_within_ulps, tiny_model, with_adapter

import finetune.generation.lean_decoder as lean_decoder
from finetune.generation.kvbatch import KVBatch
from finetune.generation.lean_decoder import LeanDecoder, describe_generation


def prefilled(model, prompts: list[list[int]]) -> tuple[KVBatch, torch.Tensor]:
    """A left-padded batch after the model's own prefill forward, and its next-token logits."""
    device = next(model.parameters()).device
    batch = KVBatch.from_prompts(prompts, ["policy"] * len(prompts), pad_token_id=0, device=device, room=8)
    logits = model(input_ids=batch.input_ids, logits_to_keep=1, **batch.forward_kwargs()).logits[:, -1]
    batch.advance()
    return batch, logits


@pytest.mark.parametrize(
    ("family", "config"),
    [("llama", {}), ("llama", {"attention_bias": True, "mlp_bias": True}), ("mistral", {"sliding_window": None}),
     ("qwen2", {}), ("qwen3", {"head_dim": 24})],
    ids=["llama", "llama-biases", "mistral", "qwen2-qkv-bias", "qwen3-qk-norm"],
)  # fmt: skip
def test_each_decode_step_gives_the_models_logits(family, config):
    """Rows of different prompt lengths (left padding), a LoRA update merged in, grouped-query attention, and
    each family's own parts (biases, Qwen3's per-head norms, a head_dim apart from hidden / heads): six decode
    steps' logits equal the model's forward over the same cache to within reordered float32 sums."""
    assert_steps_equal(with_adapter(tiny_model(family, **config)), family, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_decode_step_gives_the_models_logits_on_the_gpu(dtype):
    """The CUDA twin: Qwen3 (every part the step has but biases) in float32 and in bfloat16."""
    model = with_adapter(tiny_model("qwen3", head_dim=24)).to("cuda", dtype)
    assert_steps_equal(model, "qwen3", dtype)


def assert_steps_equal(model, family: str, dtype: torch.dtype) -> None:
    """Six greedy decode steps of three left-padded rows: the lean step's logits against the model's forward,
    within reordered sums of `dtype` (bfloat16: 16 of its own ulps at the logits' scale, for the bfloat16
    roundings of W + ΔW and of every layer's output; not yet measured on a GPU)."""
    ulps = REORDERED_ULPS if dtype == torch.float32 else 16
    prompts = [[1, 5, 9, 14, 3], [1, 7], [1, 40, 41]]
    decoder = LeanDecoder.of(model)
    assert decoder is not None
    with torch.inference_mode():
        ours, ours_logits = prefilled(model, prompts)
        theirs, logits = prefilled(model, prompts)
        for step in range(6):
            tokens = logits.argmax(-1)
            ours_logits = decoder.step(tokens, ours)
            logits = model(input_ids=tokens[:, None], logits_to_keep=1, **theirs.forward_kwargs()).logits[:, -1]
            assert_within_ulps(ours_logits.float(), logits.float(), ulps, dtype=dtype, what=f"{family} step {step}")
            ours.advance(), theirs.advance()
    assert ours.cache.get_seq_length() == theirs.cache.get_seq_length() == 5 + 6


def test_the_merged_copies_are_the_models_weights_plus_the_lora_update():
    """What the decoder computes with: W + s·B·A per projection, stacked q/k/v and gate/up, transposed."""
    model = with_adapter(tiny_model("llama"))
    decoder = LeanDecoder.of(model)
    assert decoder is not None
    q_proj = model.base_model.model.model.layers[1].self_attn.q_proj
    delta = q_proj.get_delta_weight("default")  # peft's own ΔW = s·B·A
    expected = q_proj.base_layer.weight + delta
    qkv, gate_up = decoder.layers[1].qkv, decoder.layers[1].gate_up
    assert_within_ulps(qkv.weight_t[:, : expected.shape[0]].t(), expected, REORDERED_ULPS, what="q")
    assert qkv.weight_t.is_contiguous() and gate_up.weight_t.shape == (64, 2 * 96)


def declined_models():
    """Models whose forward the lean step does not reproduce, each with (a word of) the reason it gives."""
    hooked = tiny_model("llama")
    hooked.model.layers[0].mlp.register_forward_hook(lambda module, args, output: output * 2)
    patched = tiny_model("llama")
    patched.model.norm.forward = lambda x: x  # another library's kernel in place of the class's forward
    return [
        ("sliding-window", tiny_model("mistral", sliding_window=16)),
        ("gemma models", tiny_model("gemma", head_dim=16)),
        ("DoRA", with_adapter(tiny_model("llama"), use_dora=True)),
        ("hooks", hooked),
        ("another library replaced", patched),
        ("embeddings have an adapter", with_embedding_adapter(tiny_model("llama"))),
    ]


def with_embedding_adapter(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"])).eval()


def test_it_declines_what_it_does_not_reproduce(tiny_base_dir):
    """Each of these keeps the model's own forward (None), and trainings' own lean activations do not."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    quantized = AutoModelForCausalLM.from_pretrained(tiny_base_dir, quantization_config=quantization).eval()
    models = [*declined_models(), ("quantized", quantized), ("quantized", with_adapter(quantized))]
    accepted = [why for why, model in models if LeanDecoder.of(model) is not None]
    assert accepted == []
    unsaid = [why for why, model in models if why not in describe_generation(model)]
    assert unsaid == []
    assert LeanDecoder.of(tiny_model("llama").train()) is None  # dropout would act: sampling is in eval mode
    from finetune.training.lean_activations import use_lean_activations

    model = tiny_model("llama")
    assert use_lean_activations(model) > 0
    assert LeanDecoder.of(model.eval()) is not None
    assert describe_generation(model.train()).startswith("generation: lean decode steps")


def test_without_room_for_the_copies_it_decodes_over_the_models_own_weights(monkeypatch):
    """A base whose merged copies would take more than MEMORY_SHARE of the device's memory is decoded over its
    own weights, the LoRA unmerged (each projection as peft computes it): the same logits, no copy."""
    model = with_adapter(tiny_model("qwen3", head_dim=24))
    assert LeanDecoder.of(model).merged
    inner = model.get_base_model()
    copies = sum(p.numel() * 4 for name, p in inner.named_parameters()
                 if ("proj" in name or "lm_head" in name) and "lora" not in name)  # fmt: skip
    assert lean_decoder._copies_bytes(inner) == copies
    monkeypatch.setattr(lean_decoder, "MEMORY_SHARE", copies / lean_decoder._device_memory(inner.lm_head.weight) / 2)
    decoder = LeanDecoder.of(model)
    assert decoder is not None and not decoder.merged
    q_proj = inner.model.layers[0].self_attn.q_proj
    closure = decoder.layers[0].qkv.forwards[0].__closure__ or ()
    assert any(cell.cell_contents is q_proj.base_layer for cell in closure)  # the model's own layer, no copy
    assert "own weights, the LoRA unmerged" in describe_generation(model)
    assert_steps_equal(model, "qwen3", torch.float32)


def test_a_lean_step_dispatches_under_half_the_models_ops_and_never_waits_on_the_device():
    """What predicts a decode step's host time on a GPU: each aten op is at least one kernel launch, and a
    host read makes the host wait for the queue. The lean step of a two-layer Llama dispatched 107 ops against
    the model forward's 243 (peft's LoRA and transformers' modules around the same maths), and reads nothing."""
    from bench.host_work import OpCounter
    from finetune.training.host_sync import HostSyncDetector

    model = with_adapter(tiny_model("llama"))
    decoder = LeanDecoder.of(model)
    assert decoder is not None
    with torch.inference_mode():
        ours, logits = prefilled(model, [[1, 5, 9, 14, 3], [1, 7]])
        theirs, _ = prefilled(model, [[1, 5, 9, 14, 3], [1, 7]])
        tokens = logits.argmax(-1)
        with OpCounter() as lean, HostSyncDetector() as syncs:
            decoder.step(tokens, ours)
        with OpCounter() as full:
            model(input_ids=tokens[:, None], logits_to_keep=1, **theirs.forward_kwargs())
    assert syncs.found == []
    assert lean.count <= 0.5 * full.count, (lean.count, full.count)
