"""`finetune plan`: estimates checked against a measured CPU run and against torchtune's published GPU peaks.

The CPU check trains a locally built 56M-parameter Llama for two steps in a subprocess and compares
its peak resident memory with `finetune plan --json --device cpu`. The GPU checks compare the model of
memory, set to torchtune's implementation, with the peaks torchtune publishes; finetune's own estimate
for the same recipes is higher, for the reasons the test states.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from helpers import REPO, tokenizer_corpus

from finetune.cli import main
from finetune.commands.plan import parse_memory_size
from finetune.errors import FinetuneError
from finetune.plan.memory import FINETUNE, TORCHTUNE, WHOLE_LOGITS, GiB, estimate
from finetune.plan.model_config import find_model_config
from finetune.plan.shape import model_shape
from finetune.recipe import load_recipe

# A Llama of 56.4M parameters: 23.6M in 8 decoder layers, 32.8M in an untied 32,000-token embedding and head,
# so the logits (B·T·V) are a large part of the peak, as they are for real vocabularies.
MEASURED_SHAPE = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
MEASURED_VOCAB = 32_000


def _plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def measured_base(tmp_path_factory, tiny_tokenizer):
    """A saved 56M-parameter Llama, long text records, and a recipe that fills every micro-batch: 4 x 256 tokens."""
    from transformers import LlamaForCausalLM

    from finetune.embedded.tiny import tiny_llama_config

    root = tmp_path_factory.mktemp("plan-measured")
    config = tiny_llama_config(tiny_tokenizer, **MEASURED_SHAPE)
    config.vocab_size = MEASURED_VOCAB  # more rows than the tokenizer uses: the logits are what matters here
    LlamaForCausalLM(config).save_pretrained(root / "base")
    tiny_tokenizer.save_pretrained(root / "base")
    document = " ".join(tokenizer_corpus())  # about 6,000 tokens: split into pieces of max_seq_len
    (root / "train.jsonl").write_text("".join(json.dumps({"text": document}) + "\n" for _ in range(4)))
    (root / "recipe.yaml").write_text(
        f"""
model: {{base: {root / "base"}}}
data: {{train: {root / "train.jsonl"}, format: text, max_seq_len: 256}}
train: {{max_steps: 2, micro_batch_size: 4, report_to: [], log_every_steps: 1}}
output: {{name: measured, dir: {root / "adapter"}, run_dir: {root / "run"}, report: false}}
"""
    )
    return root


def _peak_rss_of_training(recipe_path) -> int:
    """Peak RSS in bytes of `finetune train` run as the only child of a fresh interpreter (ru_maxrss is in KiB)."""
    runner = (
        "import resource, subprocess, sys\n"
        f"done = subprocess.run([sys.executable, '-m', 'finetune', 'train', {str(recipe_path)!r}], capture_output=True)\n"
        "sys.stderr.write(done.stderr.decode()[-2000:]) if done.returncode else None\n"
        "print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    done = subprocess.run([sys.executable, "-c", runner], capture_output=True, text=True, cwd=recipe_path.parent)
    returncode, max_rss_kib = done.stdout.split()
    assert returncode == "0", done.stderr
    return int(max_rss_kib) * 1024


@pytest.mark.slow
@pytest.mark.parametrize(("checkpointed", "dora"), [(0, False), (4, False)], ids=["0", "4"])
def test_estimate_is_within_10_percent_under_and_15_over_a_measured_cpu_run(measured_base, capsys, checkpointed, dora):
    """Also with the first 4 of the 8 layers checkpointed: the plan keeps 4 layers' inputs and 4 layers whole.
    (DoRA, `lora.use_dora`, measured once with `(0, True)` here: 1,883 MiB against 1,821 planned, 1,517 before its
    tensors were counted, AMD EPYC, 2026-11-28; left out of the suite for its time.)

    Over by up to 15%: `ru_maxrss` counts file-backed pages (the mapped weights) that the kernel may drop while the
    parallel suite presses on memory. With 4 layers checkpointed, 1282-1320 MiB were measured alone and 1250 MiB in
    a CI run, against 1380 planned (AMD EPYC). An estimate erring high is the safe side; under by more than 10% is not
    allowed."""
    recipe = measured_base / f"recipe-{checkpointed}{'-dora' if dora else ''}.yaml"
    settings = "train: {" + f"gradient_checkpointing: {checkpointed}, "
    text = (measured_base / "recipe.yaml").read_text().replace("train: {", settings)
    text += "lora: {use_dora: true}\n" if dora else ""
    recipe.write_text(text.replace("output: {", "output: {overwrite: true, "))
    measured = _peak_rss_of_training(recipe)
    plan = _plan_json(capsys, str(recipe), "--device", "cpu")
    assert plan["checkpointed_layers"] == checkpointed
    # Measured here: 1643 MiB peak against an estimate of 1642 MiB with the chunked loss (before it: 1905 against 1700).
    print(f"measured peak RSS {measured / 2**20:.0f} MiB, estimated {plan['peak_bytes'] / 2**20:.0f} MiB")
    print(f"activations planned: {plan['parts']['activations']['bytes'] / 2**20:.0f} MiB")
    assert -0.10 * measured <= plan["peak_bytes"] - measured <= 0.15 * measured, (plan["peak_bytes"], measured)
    # The chunked loss: 1,048 rows of 32,000 logits fit a chunk, so the micro-batch's 1,024 are one chunk (10 bytes a
    # logit), and the float32 hidden states' gradient and its scaled copy (2 x 1,024 x 512 x 4 bytes).
    assert plan["parts"]["logits"]["bytes"] == 4 * 256 * MEASURED_VOCAB * 10 + 2 * 4 * 256 * 512 * 4


# A Qwen3-MoE of 89.5M parameters: 8 layers of 16 experts (4 routed per token, 256 wide), 50.3M of them in the
# experts, with the same untied 32,000-token embedding and head and micro-batches as the dense run above.
MEASURED_MOE_SHAPE = dict(
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_experts=16,
    num_experts_per_tok=4,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


@pytest.mark.slow
def test_moe_estimate_is_within_10_percent_of_a_measured_cpu_run(measured_base, tiny_tokenizer, tmp_path, capsys):
    """The mixture of experts' parts: the experts' activations (k routed copies per token), the folded W + ΔW
    of every expert tensor, and the rest as for the dense model, on the dense run's data and recipe.

    Measured here (Intel Xeon 2.5 GHz, AVX-512, 2 cores): 2176 MiB peak RSS against an estimate of 2020 MiB
    (1922 MiB before the experts' activations were counted apart: 11.7% under). Right after loading, 302 MiB
    of RSS were pages of the base's safetensors file, which transformers keeps mapped after assembling the
    fused expert tensors from their per-expert parts (clean file pages, reclaimable, not counted by the plan).
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    root = tmp_path
    config = Qwen3MoeConfig(vocab_size=MEASURED_VOCAB, **MEASURED_MOE_SHAPE)
    config.pad_token_id, config.bos_token_id, config.eos_token_id = (
        tiny_tokenizer.pad_token_id, tiny_tokenizer.bos_token_id, tiny_tokenizer.eos_token_id,
    )  # fmt: skip
    Qwen3MoeForCausalLM(config).save_pretrained(root / "base")
    tiny_tokenizer.save_pretrained(root / "base")
    recipe = root / "recipe.yaml"  # the dense run's, on this base
    recipe.write_text((measured_base / "recipe.yaml").read_text().replace(str(measured_base), str(root)))
    (root / "train.jsonl").write_text((measured_base / "train.jsonl").read_text())
    measured = _peak_rss_of_training(recipe)
    plan = _plan_json(capsys, str(recipe), "--device", "cpu")
    print(f"measured peak RSS {measured / 2**20:.0f} MiB, estimated {plan['peak_bytes'] / 2**20:.0f} MiB")
    assert abs(plan["peak_bytes"] - measured) <= 0.10 * measured, (plan["peak_bytes"], measured)
    assert plan["moe"]["expert_params"] == 8 * 16 * 3 * 512 * 256


# torchtune's README, "Memory and training speed" (pytorch/torchtune, added in 30b8519e8, 2024-09-24): Llama 3.1 8B,
# "batch size 2 (without gradient accumulation), a dataset packed to sequence length 2048, and torch compile
# enabled", 1x RTX 4090: LoRA 16.2 GiB, QLoRA 7.4 GiB peak memory per GPU. Their configs at that commit,
# recipes/configs/llama3_1/8B_lora_single_device.yaml and 8B_qlora_single_device.yaml: lora_rank 8, alpha 16,
# q_proj/v_proj/output_proj + MLP, dtype bf16, enable_activation_checkpointing True, CEWithChunkedOutputLoss;
# QLoRA quantizes the decoder's linear layers to NF4 and keeps embeddings and output in bf16.
# Our catalog recipes llama-3.1-8b-instruct-chat(-qlora) copy those settings. torch's allocator statistics
# (what torchtune logs) leave out the CUDA context, so the comparison leaves out the `runtime` part.
TORCHTUNE_PEAKS_GIB = {"llama-3.1-8b-instruct-chat": 16.2, "llama-3.1-8b-instruct-chat-qlora": 7.4}


@pytest.mark.parametrize("name", sorted(TORCHTUNE_PEAKS_GIB))
def test_estimate_is_within_25_percent_of_torchtunes_published_peaks(name):
    recipe = load_recipe(name, ["data.max_seq_len=2048", "train.micro_batch_size=2"])
    config, source = find_model_config(recipe.model.base)
    shape = model_shape(config, recipe.lora)
    assert shape.base_params == 8_030_261_248
    lora_per_layer = 8 * ((4096 + 4096) * 2 + (4096 + 1024) + 3 * (4096 + 14336))  # q, o, v, gate/up/down
    assert shape.lora_params == 32 * lora_per_layer == 19_660_800
    plan = estimate(recipe, shape, device="cuda", impl=TORCHTUNE)
    allocated = plan.peak_bytes - plan.as_json()["parts"]["runtime"]["bytes"]
    published = TORCHTUNE_PEAKS_GIB[name] * GiB
    assert abs(allocated - published) <= 0.25 * published, (allocated / GiB, TORCHTUNE_PEAKS_GIB[name])
    # finetune's chunked loss never holds the whole logits: it saves what the whole float32 logits cost (12 bytes
    # per logit, 5.9 GiB here) but for a chunk, and the peak is then set by the recomputed layer, not the loss.
    ours = estimate(recipe, shape, device="cuda", impl=FINETUNE)
    whole = estimate(recipe, shape, device="cuda", impl=WHOLE_LOGITS)
    assert whole.peak_bytes - ours.peak_bytes > 4 * GiB
    assert ours.as_json()["parts"]["logits"]["bytes"] * 8 < whole.as_json()["parts"]["logits"]["bytes"]


@pytest.mark.parametrize("dtype, unquantized_bytes", [("bfloat16", 2), ("float16", 4)])
def test_json_has_the_peak_and_every_part_with_where_it_lives(capsys, dtype, unquantized_bytes):
    plan = _plan_json(capsys, "llama-3.1-8b-instruct-chat-qlora", f"model.dtype={dtype}", "--device", "cuda")
    assert set(plan["parts"]) == {"weights", "lora", "gradients", "optimizer", "activations", "logits", "runtime"}
    assert plan["peak_bytes"] == sum(part["bytes"] for part in plan["parts"].values())
    assert all(part["where"] == "device" for part in plan["parts"].values())
    # 4-bit nf4 with double quantization: 0.5 byte per decoder weight + 1/64 + 4/(64*256) for the block scales;
    # the 1,050,673,152 embedding, head and norm weights bitsandbytes leaves unquantized stay bf16, and only a
    # float16 base has them upcast to float32 by peft's kbit preparation (finetune.model._upcasts_unquantized).
    decoder_weights = 8_030_261_248 - 2 * 128_256 * 4096 - (2 * 32 + 1) * 4096
    expected = int(decoder_weights * (0.5 + 1 / 64 + 4 / (64 * 256)))
    assert plan["parts"]["weights"]["bytes"] == expected + (8_030_261_248 - decoder_weights) * unquantized_bytes


def test_offloaded_parts_live_on_the_host_and_leave_the_device_peak(capsys):
    dense = _plan_json(
        capsys, "llama-3.1-8b-instruct-chat", "distributed.strategy=fsdp", "--nproc", "2", "--device", "cuda"
    )
    offload = ["distributed.strategy=fsdp", "distributed.fsdp.cpu_offload=true"]
    offloaded = _plan_json(capsys, "llama-3.1-8b-instruct-chat", *offload, "--nproc", "2", "--device", "cuda")
    assert offloaded["parts"]["weights"]["where"] == "host"
    assert offloaded["host_bytes"] >= dense["parts"]["weights"]["bytes"]
    assert offloaded["peak_bytes"] == dense["peak_bytes"] - offloaded["host_bytes"]


def test_fsdp_over_two_ranks_needs_less_per_rank_than_ddp(capsys):
    args = ("llama-3.1-8b-instruct-chat", "--nproc", "2", "--device", "cuda")
    ddp = _plan_json(capsys, *args)
    fsdp = _plan_json(capsys, *args, "distributed.strategy=fsdp")
    grad_op = _plan_json(capsys, *args, "distributed.strategy=fsdp", "distributed.fsdp.sharding=grad_op")
    assert fsdp["parts"]["weights"]["bytes"] == ddp["parts"]["weights"]["bytes"] // 2
    assert fsdp["peak_bytes"] < grad_op["peak_bytes"]  # grad_op keeps every layer gathered from forward to backward
    assert fsdp["peak_bytes"] < ddp["peak_bytes"] - 6 * GiB


def test_human_view_says_whether_it_fits_and_what_to_change(capsys):
    assert main(["plan", "llama-3.1-8b-instruct-chat", "--device", "cuda", "--device-memory", "80GB"]) == 0
    fits = capsys.readouterr().out
    assert "fits 80.00 GiB: yes" in fits and "weights" in fits and "logits" in fits
    assert main(["plan", "llama-3.1-8b-instruct-chat", "--device", "cuda", "--device-memory", "16GB"]) == 0
    short = capsys.readouterr().out
    assert "fits 16.00 GiB: no" in short
    assert "QLoRA: 4-bit nf4 base: peak" in short and "(model.quantization=4bit)" in short
    assert "FSDP over 2 devices" in short and "--nproc 2" in short
    assert "micro-batch 1 x 16 accumulation" in short


def test_checkpointing_n_layers_keeps_the_others_whole_and_auto_picks_the_fewest_that_fit(capsys):
    args = ["llama-3.1-8b-instruct-chat-qlora", "--device", "cuda", "train.micro_batch_size=2", "data.max_seq_len=2048"]
    peak = {n: _plan_json(capsys, *args, f"train.gradient_checkpointing={n}")["peak_bytes"] for n in (0, 1, 10, 32)}
    saved_per_layer = peak[0] - peak[1]  # a layer's activations less the input it keeps
    assert saved_per_layer > 0 and abs((peak[0] - peak[10]) - 10 * saved_per_layer) <= 10  # linear in the count
    auto = _plan_json(capsys, *args, "train.gradient_checkpointing=auto", "--device-memory", "24GB")
    chosen = auto["checkpointed_layers"]
    assert 0 < chosen < auto["num_layers"] == 32
    one_fewer = _plan_json(capsys, *args, f"train.gradient_checkpointing={chosen - 1}", "--device-memory", "24GB")
    assert auto["peak_bytes"] <= 0.9 * 24 * GiB < one_fewer["peak_bytes"]  # the fewest that fit 90% of the card
    roomy = _plan_json(capsys, *args, "train.gradient_checkpointing=auto", "--device-memory", "80GB")
    assert (roomy["checkpointed_layers"], roomy["peak_bytes"]) == (0, peak[0])
    unknown_memory = _plan_json(capsys, *args, "train.gradient_checkpointing=auto")
    assert unknown_memory["checkpointed_layers"] == 32  # every layer, the safe choice
    assert main(["plan", *args, "train.gradient_checkpointing=auto", "--device-memory", "24GB"]) == 0
    assert f"gradient checkpointing on for {chosen} of 32 layers (auto)" in capsys.readouterr().out
    # a recipe that checkpoints every layer is told, where the device has room, that auto recomputes less
    every_layer = _plan_json(capsys, *args, "train.gradient_checkpointing=true", "--device-memory", "24GB")
    assert every_layer["notes"] == [
        f"faster here: train.gradient_checkpointing=auto checkpoints {chosen} of 32 layers on this device "
        f"(peak {auto['peak_bytes'] / GiB:.2f} GiB), recomputing less"
    ]
    assert _plan_json(capsys, *args, "train.gradient_checkpointing=true", "--device-memory", "8GB")["notes"] == []


def test_json_suggestions_each_carry_their_own_peak(capsys):
    plan = _plan_json(capsys, "llama-3.1-8b-instruct-chat", "--device", "cuda", "--device-memory", "16GB")
    assert plan["fits"] is False
    by_change = {s["change"]: s for s in plan["suggestions"]}
    qlora = by_change["QLoRA: 4-bit nf4 base"]
    assert qlora["fits"] and qlora["peak_bytes"] < 16 * GiB < plan["peak_bytes"]


def test_embedded_base_and_a_given_config_work(capsys, tiny_base_dir):
    embedded = _plan_json(capsys, str(REPO / "recipes" / "quickstart.yaml"), "--device", "cpu")
    assert embedded["parts"]["lora"]["bytes"] > 0
    given = _plan_json(
        capsys, "qwen3-4b-chat", "model.base=org/not-here", "--config", str(tiny_base_dir), "--device", "cpu"
    )
    vocab_size = json.loads((tiny_base_dir / "config.json").read_text())["vocab_size"]
    assert given["parts"]["logits"]["note"].endswith(f" {vocab_size:,} vocabulary")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["no-such-recipe"], "neither a file nor a catalog recipe"),
        (["qwen3-4b-chat", "model.base=org/not-here"], "--config PATH"),
        (["qwen3-4b-chat", "--config", "/nonexistent/config.json"], "no such file"),
        (["qwen3-4b-chat", "--device-memory", "lots"], "not a size"),
        (["qwen3-4b-chat", "lora.target_modules=[nope]"], "match no module"),
    ],
)
def test_bad_input_is_a_one_line_error(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vocab_size": "512"}, "vocab_size' expected int, got str"),
        ({"num_hidden_layers": 2.5}, "num_hidden_layers' expected int, got float"),
        ({"num_key_value_heads": 0}, "cannot build a llama model"),
        ({"hidden_size": -64}, "negative dimension"),
        ({"vocab_size": 0, "pad_token_id": None}, "vocab_size 0: a model needs at least one token"),
        ({"pad_token_id": 10**6}, "Padding_idx must be within num_embeddings"),
    ],
    ids=["vocab-text", "layers-fraction", "no-kv-heads", "negative-width", "no-vocabulary", "pad-past-vocabulary"],
)
def test_a_config_json_with_a_field_no_model_can_have_is_one_line(tmp_path, tiny_base_dir, capsys, change, message):
    """A hand-edited config.json (a number written as text, 0 heads) is one line naming the file and the field, from
    `plan` (given as --config, or found from model.base) and from `eval`, not a traceback from transformers."""
    base = tmp_path / "base"
    shutil.copytree(tiny_base_dir, base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, **change}))
    runs = [["plan", "quickstart", "--config", str(base)], ["plan", "quickstart", f"model.base={base}"]]
    if isinstance(next(iter(change.values())), str):  # a field of another type stops the load of the weights too
        (tmp_path / "d.jsonl").write_text('{"text": "the model reads a document"}\n')
        runs.append(["eval", "--base", str(base), "--data", str(tmp_path / "d.jsonl")])
    for number, argv in enumerate(runs):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], (argv, err)
        assert number == 0 or not err[0].startswith("error: --config"), err  # named only where it was given


def test_more_experts_routed_per_token_than_there_are_is_one_line(tmp_path, capsys):
    """top-k above the experts builds on the meta device but no forward runs (`torch.topk`); the plan said "46.84B
    active per token" of Qwen3-30B-A3B's 30.53B. It is refused in one line instead."""
    from finetune.plan.model_config import SHIPPED_CONFIGS

    config = json.loads((SHIPPED_CONFIGS / "Qwen" / "Qwen3-30B-A3B.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": config["num_experts"] + 1}))
    assert main(["plan", "qwen3-30b-a3b-chat", "--config", str(tmp_path), "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: config.json routes 129 experts per token but has only 128; fix the config (or give "
                   "--config another one)"]  # fmt: skip


def test_key_value_heads_that_do_not_divide_the_heads_are_one_line(tmp_path, capsys):
    """32 heads in 3 key/value groups build on the meta device, and the plan gave figures, but the attention's
    first forward fails. Refused in one line instead."""
    from finetune.plan.model_config import SHIPPED_CONFIGS

    config = json.loads((SHIPPED_CONFIGS / "meta-llama" / "Llama-3.1-8B.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 3}))
    assert main(["plan", "llama-3.1-8b-instruction", "--config", str(tmp_path), "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "32 attention heads in 3 key/value groups, which do not divide them" in err[0]


def test_cli_subprocess_exits_2_without_traceback(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "finetune", "plan", "qwen3-4b-chat", "model.base=org/not-here"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "error: config of model.base 'org/not-here' not found" in done.stderr


@pytest.mark.parametrize(
    "text, expected",
    [
        ("24GB", 24 * GiB),
        ("24GiB", 24 * GiB),
        ("1.5G", int(1.5 * GiB)),
        ("512MB", 512 * 2**20),
        ("2000000", 2_000_000),
    ],  # fmt: skip
)
def test_memory_sizes(text, expected):
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("text", ["0", "16", "0GB", "24 apples"])
def test_a_size_without_its_unit_or_of_nothing_is_refused(text):
    with pytest.raises(FinetuneError, match=f"--device-memory '{text}'"):
        parse_memory_size(text)


def test_a_recipe_object_takes_overrides_without_tripping_over_unset_strategy_options():
    recipe = load_recipe("llama-3.1-8b-instruct-chat")
    assert load_recipe(recipe, ["train.micro_batch_size=1"]).train.micro_batch_size == 1
    fsdp = load_recipe(load_recipe("llama-3.1-8b-instruct-chat", ["distributed.strategy=fsdp"]), ["lora.r=4"])
    assert fsdp.distributed.strategy == "fsdp" and fsdp.lora.r == 4


def test_grpo_counts_the_merged_sampling_weights_only_where_the_lean_decoder_makes_them(capsys):
    """GRPO's lean decode step samples from a copy of the decoder layers' linear weights and the head with the
    LoRA merged in, made only when it fits in 1/8 of the device (here Qwen3-4B in bf16: 7.5 GiB, so on 80 GB
    and not on 40 GB) and never for a 4-bit base."""
    from finetune.plan.memory import DTYPE_BYTES
    from finetune.plan.model_config import find_model_config
    from finetune.plan.shape import model_shape
    from finetune.recipe import load_recipe

    name = "qwen3-4b-base-grpo-gsm8k"
    recipe = load_recipe(name)
    shape = model_shape(find_model_config(recipe.model.base, recipe.model.revision, None)[0], recipe.lora)
    copies = (shape.quantizable_params + shape.vocab_size * shape.hidden_size) * DTYPE_BYTES[recipe.model.dtype]
    roomy = _plan_json(capsys, name, "--device", "cuda", "--device-memory", "80GB")
    assert roomy["parts"]["sampling weights"]["bytes"] == copies
    assert "sampling weights" not in _plan_json(capsys, name, "--device", "cuda", "--device-memory", "40GB")["parts"]
    quantized = _plan_json(capsys, name, "model.quantization=4bit", "--device", "cuda", "--device-memory", "80GB")
    assert "sampling weights" not in quantized["parts"]


def test_a_cpu_plan_of_a_large_micro_batch_says_the_heap_can_hold_more(capsys):
    """On the CPU glibc's heap keeps freed tensor memory: from 1,024 tokens per micro-batch the measured peak RSS
    was above the plan (`bench/plan_accuracy.py`: 1.1x at 1,024, 1.5x at 4,096), so the plan says so there."""
    from finetune.commands.plan import CPU_HEAP_TOKENS

    def notes(*overrides: str, device: str = "cpu") -> list[str]:
        return _plan_json(capsys, "recipes/quickstart.yaml", "--device", device, *overrides)["notes"]

    assert CPU_HEAP_TOKENS == 4 * 256
    assert not any("glibc" in note for note in notes("train.micro_batch_size=2", "data.max_seq_len=256"))
    (note,) = [note for note in notes("train.micro_batch_size=16", "data.max_seq_len=256") if "glibc" in note]
    assert "at 4,096 tokens per micro-batch" in note
    assert not any("glibc" in note for note in notes("train.micro_batch_size=16", device="cuda"))


def test_a_peak_of_100_gib_or_more_stays_in_the_gib_column(capsys):
    """The table's widths count the peak line: a peak wider than every part (Qwen3-30B-A3B without checkpointing,
    138 GiB) had its figure a character right of the column."""
    argv = ["plan", "qwen3-30b-a3b-chat", "train.gradient_checkpointing=false", "--device", "cuda"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("part "))) :]
    table = table[: next(i for i, line in enumerate(table) if line.startswith("peak ")) + 1]
    assert float(table[-1].split()[1]) >= 100
    ends = {line.index(" GiB") + 4 if line.startswith("part ") else line.index(".") + 3 for line in table}
    assert len(ends) == 1, table


def test_dora_is_counted_and_said_so(capsys):
    """`lora.use_dora` keeps the base layer's and `lora_B`'s outputs per token and DoRA layer (2 x out in bf16 here:
    the recipe's q, v, o, gate, up and down on Llama 3.1 8B give 4096 + 1024 + 4096 + 2 x 14336 + 4096 out features),
    and builds a (14336, 14336) identity in the down projection's forward, above the logits here."""
    from finetune.plan.memory import dora_bytes_per_token, layer_activation_bytes_per_token

    args = ["llama-3.1-8b-instruct-chat", "train.micro_batch_size=2", "data.max_seq_len=2048"]
    lora, dora = load_recipe(args[0], args[1:]), load_recipe(args[0], [*args[1:], "lora.use_dora=true"])
    config = find_model_config(lora.model.base, lora.model.revision, None)[0]
    shapes = model_shape(config, lora.lora), model_shape(config, dora.lora)
    outputs = 3 * 4096 + 1024 + 2 * 14336
    assert (shapes[0].dora_outputs, shapes[1].dora_outputs) == (0, outputs)
    assert dora_bytes_per_token(dora.for_device("cuda"), shapes[1]) == 2 * outputs * 2
    per_token = [layer_activation_bytes_per_token(r.for_device("cuda"), s, 2048) for r, s in zip((lora, dora), shapes)]
    assert per_token[1] - per_token[0] == 2 * outputs * 2
    plan = _plan_json(capsys, *args, "lora.use_dora=true", "--device", "cuda")
    assert "DoRA" in plan["parts"]["activations"]["note"] and plan["parts"]["dora"]["bytes"] > 0
    assert "dora" not in _plan_json(capsys, *args, "--device", "cuda")["parts"]
    assert main(["plan", *args, "lora.use_dora=true", "--device", "cuda"]) == 0
    assert "DoRA's 167,936 bytes more per token and layer counted" in capsys.readouterr().out
