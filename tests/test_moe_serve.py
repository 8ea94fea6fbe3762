"""Mixture-of-experts adapters in unmerged forwards: per row of a batch (`finetune serve`'s per-request adapters)
and for the whole batch (`finetune generate --adapter`), each row equal to the model with its adapter merged.

The reference is always `LoadedModel.merge` (which equals plain peft's `merge_and_unload`, tests/test_moe.py).
With LoRA on the experts only (the linear layers' B = 0, an exact zero merged or not) the unmerged forward
computes with the merged expert tensors themselves, so in bf16 the whole-batch forward is bit for bit the
merged model's; per row, each expert runs on fewer tokens at a time, so a few ulps are allowed.
"""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from helpers import REORDERED_ULPS, ROUNDED_ULPS, assert_within_ulps
from moe_helpers import FAMILIES, MOE_SHAPE, build_moe, merged_logits, moe_adapter

import finetune
from finetune.adapters.experts import expert_tensors, routers
from finetune.cli import main
from finetune.errors import AdapterError
from finetune.prompting import prompt_ids
from finetune.serve.server import ServerThread
from finetune.serve.settings import BASE_ROW, ServeSettings

ROWS = ["two", BASE_ROW, "one", "two"]
"""A mixed batch: two rows of one adapter apart, a base row between."""
PROMPTS = ["the model reads a document", "def add(a, b):\n", "for i in range(10):\n    print(i * 2)"]
MAX_TOKENS = 12


def load(base_dir: Path, adapters: dict[str, Path], dtype: str = "float32") -> finetune.LoadedModel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the seeded adapters have no manifest: nothing to check the base with
        return finetune.load_model(str(base_dir), {n: str(p) for n, p in adapters.items()}, dtype=dtype)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_row_computes_with_its_adapter_merged_on_experts_and_router(family, tmp_path, tiny_tokenizer):
    """LoRA on the experts and on the router (`lora.train_router`; no family's router is an nn.Linear, so
    peft reaches it as a raw parameter too); the linear layers' LoRA is zero."""
    base_dir = build_moe(family, tmp_path / "base", tiny_tokenizer)
    seeds = (("one", 1), ("two", 2))
    adapters = {n: moe_adapter(base_dir, tmp_path / n, seed=s, linear=False, train_router=True) for n, s in seeds}
    m = load(base_dir, adapters, "bfloat16")
    assert set(routers(m.model, expert_tensors(m.model))) <= set(m.adapters["one"].modules)
    ids = torch.arange(3, 3 + 8 * len(ROWS)).reshape(len(ROWS), 8)
    expected = merged_logits(m, [None, "one", "two"], ids)
    assert not torch.equal(expected["one"], expected[None]) and not torch.equal(expected["two"], expected[None])
    m.use("one")  # the whole batch: the merged tensors themselves, bit for bit
    with torch.no_grad():
        assert torch.equal(m.model(input_ids=ids).logits, expected["one"])
    m.use(None)
    with torch.no_grad():
        assert torch.equal(m.model(input_ids=ids).logits, expected[None])
    m.attach("two")
    with torch.no_grad():
        logits = m.use_per_row()(input_ids=ids, adapter_names=ROWS).logits
    for row, name in enumerate(ROWS):
        reference = expected[None if name == BASE_ROW else name][row]
        assert_within_ulps(logits[row], reference, ROUNDED_ULPS, dtype=torch.bfloat16, what=f"row {row} ({name})")


def test_rows_with_linear_and_expert_lora_and_something_merged_underneath(tmp_path, tiny_tokenizer):
    """Adapters on linear layers and experts (peft computes the linear LoRA per row, unmerged), with a third
    adapter merged under every row: each row equals the model with the merged one and its own merged."""
    base_dir = build_moe("qwen3_moe", tmp_path / "base", tiny_tokenizer)
    seeds = {"one": 1, "two": 2, "under": 3}
    m = load(base_dir, {n: moe_adapter(base_dir, tmp_path / n, seed=s) for n, s in seeds.items()})
    m.merge("under", 0.5)
    assert_rows_equal_their_merges(m)
    assert m.merged == {"under": 0.5}


def assert_rows_equal_their_merges(m) -> None:
    """One forward of `ROWS` (the base, `one`, `two`) per row: each row equals the model with its adapter merged."""
    ids = torch.arange(3, 3 + 8 * len(ROWS)).reshape(len(ROWS), 8)
    expected = merged_logits(m, [None, "one", "two"], ids)
    m.attach("one"), m.attach("two")
    with torch.no_grad():
        logits = m.use_per_row()(input_ids=ids, adapter_names=ROWS).logits
    for row, name in enumerate(ROWS):
        reference = expected[None if name == BASE_ROW else name][row]
        assert_within_ulps(logits[row], reference, REORDERED_ULPS, what=f"row {row} ({name})")


def qwen2_moe(out: Path, tokenizer) -> Path:
    """Qwen2-MoE: a shared expert (plain linear layers, which `all-linear` trains) fed the block's flattened tokens."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    torch.manual_seed(0)
    config = Qwen2MoeConfig(
        **MOE_SHAPE, moe_intermediate_size=32, num_experts=4, shared_expert_intermediate_size=32, intermediate_size=64
    )
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 2
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_rows_where_linear_layers_or_the_router_see_the_blocks_tokens(family, tmp_path, tiny_tokenizer):
    """Qwen2-MoE's shared expert gets (batch·seq, hidden) tokens, and peft's per-row LoRA refused them ("Length of
    `adapter_names` should be the same as the number of inputs"): every prefill `finetune serve` ran with an adapter
    failed. DeepSeek-V3's router takes (batch, seq, hidden) and returns one row per token: rows of router LoRA
    failed to be put back together. Each row now equals the model with its adapter merged."""
    base_dir = qwen2_moe(tmp_path / "base", tiny_tokenizer) if family == "qwen2_moe" else None
    base_dir = base_dir or build_moe(family, tmp_path / "base", tiny_tokenizer)
    seeds = (("one", 1), ("two", 2))
    m = load(base_dir, {n: moe_adapter(base_dir, tmp_path / n, seed=s, train_router=True) for n, s in seeds})
    assert_rows_equal_their_merges(m)


def test_experts_that_take_tokens_in_their_own_order_refuse_rows_of_different_adapters(tmp_path, tiny_tokenizer):
    """Llama 4's experts take every token once per expert (`repeat`), not row by row: grouped by row, each row's
    experts computed with other rows' tokens, silently wrong. A mixed batch is refused in one line; one adapter for
    the whole batch still equals the merged model."""
    from transformers import AutoModelForCausalLM, Llama4TextConfig

    torch.manual_seed(0)
    config = Llama4TextConfig(
        **MOE_SHAPE, intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4, head_dim=16,
        moe_layers=[0, 1], no_rope_layers=[1, 1],
    )  # fmt: skip
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 2
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    tiny_tokenizer.save_pretrained(tmp_path / "base")
    m = load(tmp_path / "base", {"one": moe_adapter(tmp_path / "base", tmp_path / "one", seed=1)})
    ids = torch.arange(3, 3 + 8 * len(ROWS)).reshape(len(ROWS), 8)
    expected = merged_logits(m, ["one"], ids)["one"]
    m.use("one")
    with torch.no_grad():
        assert_within_ulps(m.model(input_ids=ids).logits, expected, REORDERED_ULPS, what="the whole batch")
    m.use(None)
    m.attach("one")
    with pytest.raises(AdapterError, match=r"experts \(Llama4TextExperts\) takes its tokens in an order of its own"):
        with torch.no_grad():
            m.use_per_row()(input_ids=ids, adapter_names=["one", BASE_ROW, "one", "one"])


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_tokenizer) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("moe-serve")
    base_dir = build_moe("qwen3_moe", root / "base", tiny_tokenizer)
    seeds = (("one", 1), ("two", 2), ("three", 3))  # three: loaded while the server runs
    return base_dir, {n: moe_adapter(base_dir, root / n, seed=s) for n, s in seeds}


def merged_greedy(base_dir: Path, adapters: dict[str, Path], name: str | None, prompt: str) -> list[int]:
    """Greedy tokens of the model with adapter `name` merged (`finetune adapters merge`, then generate)."""
    m = load(base_dir, adapters)
    if name is not None:
        m.merge(name)
    ids = prompt_ids(m.tokenizer, prompt)
    with torch.no_grad():
        output = m.model.generate(
            torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=m.tokenizer.pad_token_id
        )
    return output[0, len(ids) :].tolist()


def test_serve_answers_each_request_as_its_adapter_merged(served):
    base_dir, adapters = served
    at_start = {n: str(adapters[n]) for n in ("one", "two")}
    settings = ServeSettings(base=str(base_dir), adapters=at_start, base_name="base", port=0, max_wait_ms=50)
    jobs = [(model, prompt) for model in ("base", "one", "two") for prompt in PROMPTS[:2]]
    with ServerThread(settings) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        body = {"max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}

        def complete(job: tuple[str, str]) -> list[int]:
            response = client.post("/v1/completions", json={**body, "model": job[0], "prompt": job[1]})
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = dict(zip(jobs, pool.map(complete, jobs)))
        stats = client.get("/stats").json()
        added = client.post("/v1/load_lora_adapter", json={"lora_name": "three", "lora_path": str(adapters["three"])})
        assert added.status_code == 200, added.text
        answers["three", PROMPTS[0]] = complete(("three", PROMPTS[0]))
    assert stats["forwards_by_model_count"].get("3", 0) > 0  # base, one and two rows in one forward
    for (model, prompt), tokens in answers.items():
        assert tokens == merged_greedy(base_dir, adapters, None if model == "base" else model, prompt), model
    for prompt in PROMPTS[:2]:  # the adapters really change the answers
        assert len({tuple(answers[model, prompt]) for model in ("base", "one", "two")}) == 3


def test_finetune_generate_with_an_moe_adapter_prints_the_merged_models_text(served, capsys):
    base_dir, adapters = served
    arguments = ["generate", "--base", str(base_dir), "--adapter", str(adapters["one"]), PROMPTS[2]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main([*arguments, "--max-new-tokens", str(MAX_TOKENS)]) == 0
    tokens = merged_greedy(base_dir, adapters, "one", PROMPTS[2])
    tokenizer = load(base_dir, {}).tokenizer
    assert capsys.readouterr().out == tokenizer.decode(tokens, skip_special_tokens=True) + "\n"
