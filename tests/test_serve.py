"""`finetune serve` for real: uvicorn on 127.0.0.1 (a free port), talked to with httpx and the `openai` client.

Every answer is checked against the same greedy tokens computed apart from the server: through
`finetune.load_model` + `use` + `generate` (what `finetune generate` runs; once through the real
`finetune generate` subprocess too). Concurrent requests for two adapters and the base must come back
with the tokens each gets alone, and the server's /stats must show they shared forward passes.

The base: the embedded one if this session already built it (the quickstart test does), else the tiny
test base built with larger initial weights (`initializer_range=0.3`): the default tiny base repeats
one token forever under greedy decoding, which would hide a wrong position or cache row.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from helpers import ALL_LINEAR, REPO, TEST_SHAPE, greedy_ids, make_adapter

import finetune
from finetune.cli import main
from finetune.errors import ServeError
from finetune.prompting import chat_prompt_ids, prompt_ids
from finetune.serve.server import ServerThread
from finetune.serve.settings import ServeSettings

BASE_NAME = "tiny"
PROMPTS = ["the model reads a document", "def add(a, b):\n", "for i in range(10):\n    print(i * 2)", "loss"]
MAX_TOKENS = 16
MAX_TOKENS_LIMIT = 64
MAX_PENDING = 16


@pytest.fixture(scope="module")
def serve_base(tmp_path_factory, tiny_tokenizer) -> Path:
    from finetune.embedded.build import EMBEDDED_BASES
    from finetune.embedded.cache import embedded_base_dir
    from finetune.embedded.shipped import RECORD_FILE
    from finetune.embedded.tiny import build_tiny_llama

    embedded = embedded_base_dir("tiny-llama", EMBEDDED_BASES["tiny-llama"])
    if (embedded / RECORD_FILE).is_file():
        return embedded
    path = tmp_path_factory.mktemp("serve-base")
    build_tiny_llama(tiny_tokenizer, seed=0, initializer_range=0.3, **TEST_SHAPE).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def serve_adapters(tmp_path_factory, serve_base, tiny_base_dir) -> dict[str, Path]:
    """Two adapters served from the start, one loaded at runtime, and two the server must refuse."""
    root = tmp_path_factory.mktemp("serve-adapters")
    adapters = {
        "legal": make_adapter(serve_base, root / "legal", seed=11, targets=ALL_LINEAR, magnitude=0.3),
        "med": make_adapter(serve_base, root / "med", seed=12, targets=("q_proj", "v_proj", "down_proj"), r=8),
        "code": make_adapter(serve_base, root / "code", seed=13, targets=("v_proj", "up_proj"), magnitude=0.4),
        "foreign": make_adapter(tiny_base_dir, root / "foreign", seed=14),  # same shapes, other weights
        "overflowing": make_adapter(serve_base, root / "overflowing", seed=15, magnitude=1e20),  # NaN scores
    }
    untargeted = shutil.copytree(adapters["code"], root / "untargeted")  # weights on modules its config omits
    config = json.loads((untargeted / "adapter_config.json").read_text())
    (untargeted / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["v_proj"]}))
    pickled = shutil.copytree(adapters["code"], root / "pickled")
    from safetensors.torch import load_file

    torch.save(load_file(pickled / "adapter_model.safetensors"), pickled / "adapter_model.bin")
    (pickled / "adapter_model.safetensors").unlink()
    return {**adapters, "pickled": pickled, "untargeted": untargeted}


@pytest.fixture(scope="module")
def reference(serve_base, serve_adapters):
    """The same base and adapters loaded apart from the server: what `finetune generate` computes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return finetune.load_model(serve_base, {n: serve_adapters[n] for n in ("legal", "med", "code")})


def greedy(loaded, model: str | None, ids: list[int], max_new_tokens: int = MAX_TOKENS) -> list[int]:
    """`finetune generate`'s computation: `use(adapter)` then greedy `generate` on one unpadded row."""
    loaded.use(model)
    input_ids = torch.tensor([ids], device=loaded.device)
    with torch.no_grad():
        output = loaded.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=loaded.tokenizer.pad_token_id,
            eos_token_id=loaded.tokenizer.eos_token_id,
        )
    loaded.use(None)
    return output[0, len(ids) :].tolist()


def adapter_of(model: str) -> str | None:
    return None if model == BASE_NAME else model


@pytest.fixture(scope="module")
def server(serve_base, serve_adapters):
    settings = ServeSettings(
        base=str(serve_base),
        adapters={"legal": str(serve_adapters["legal"]), "med": str(serve_adapters["med"])},
        base_name=BASE_NAME,
        port=0,
        max_wait_ms=50,
        max_tokens_limit=MAX_TOKENS_LIMIT,
        max_pending=MAX_PENDING,
    )
    with ServerThread(settings) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        yield http


def complete(client: httpx.Client, model: str, prompt: str, **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    response = client.post("/v1/completions", json={**body, **extra})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def assert_error(response: httpx.Response, status: int, *fragments: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for fragment in fragments:
        assert fragment in error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def assert_still_serves(client: httpx.Client, reference) -> None:
    choice = complete(client, "legal", PROMPTS[0])
    assert choice["token_ids"] == greedy(reference, "legal", prompt_ids(reference.tokenizer, PROMPTS[0]))


# ---- answers equal finetune generate ---------------------------------------------------------------
def test_the_reference_is_greedy_decoding_by_hand(serve_base, serve_adapters, reference):
    """What every answer is compared with is itself right: the tokens of greedy decoding by hand (a full
    forward pass per token, argmax) on the base alone and on the base with an adapter loaded by plain peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    eos = reference.tokenizer.eos_token_id
    for prompt, adapter in ((PROMPTS[0], "med"), (PROMPTS[2], None)):
        ids = prompt_ids(reference.tokenizer, prompt)
        model = AutoModelForCausalLM.from_pretrained(serve_base, dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, str(serve_adapters[adapter]))
        expected = greedy_ids(model.eval(), ids, MAX_TOKENS, eos)
        assert len(set(expected)) > 2, expected  # varied tokens: a wrong position or cache row would show
        assert greedy(reference, adapter, ids) == expected


def test_models_are_listed(client, serve_adapters):
    listed = client.get("/v1/models").json()
    assert listed["object"] == "list"
    cards = {card["id"]: card for card in listed["data"]}
    assert set(cards) == {BASE_NAME, "legal", "med"}
    assert cards["legal"]["parent"] == BASE_NAME and cards["legal"]["root"] == str(serve_adapters["legal"])
    assert cards[BASE_NAME]["parent"] is None


def test_completions_per_model_equal_generate(client, reference):
    outputs = {}
    for model in (BASE_NAME, "legal", "med"):
        for prompt in PROMPTS[:2]:
            choice = complete(client, model, prompt)
            ids = prompt_ids(reference.tokenizer, prompt)
            expected = greedy(reference, adapter_of(model), ids)
            assert choice["prompt_token_ids"] == ids
            assert choice["token_ids"] == expected, (model, prompt)
            assert choice["text"] == reference.tokenizer.decode(expected, skip_special_tokens=True)
            outputs[model, prompt] = tuple(expected)
    for prompt in PROMPTS[:2]:  # the adapters really change the answers
        assert len({outputs[model, prompt] for model in (BASE_NAME, "legal", "med")}) == 3
    ids = [prompt_ids(reference.tokenizer, prompt) for prompt in PROMPTS[:2]]  # token ids as the prompt, as OpenAI's
    for prompt, expected in ((ids[0], ids[:1]), (ids, ids)):
        body = {
            "model": "legal",
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        }
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert [c["prompt_token_ids"] for c in choices] == expected
        assert [tuple(c["token_ids"]) for c in choices] == [outputs["legal", p] for p in PROMPTS[: len(expected)]]


@pytest.mark.gpu
def test_on_a_gpu_the_server_runs_there_and_equals_generate_there(client, reference):
    """`auto` puts both on the GPU: every input the server builds must be there too (it built them on the CPU)."""
    assert reference.device.type == "cuda" and all(p.is_cuda for p in reference.model.parameters())
    assert client.get("/stats").status_code == 200
    for model in (BASE_NAME, "med"):
        ids = prompt_ids(reference.tokenizer, PROMPTS[0])
        assert complete(client, model, PROMPTS[0], seed=1)["token_ids"] == greedy(reference, adapter_of(model), ids)
        sampled = complete(client, model, PROMPTS[0], temperature=0.8, seed=3)["token_ids"]
        assert sampled == complete(client, model, PROMPTS[0], temperature=0.8, seed=3)["token_ids"]


def test_chat_completions_with_the_openai_client_equal_generate(server, reference):
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPTS[2]}]
    for model in (BASE_NAME, "med"):
        reply = api.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        expected = greedy(reference, adapter_of(model), chat_prompt_ids(reference.tokenizer, messages))
        assert reply.choices[0].message.content == reference.tokenizer.decode(expected, skip_special_tokens=True)
        assert reply.choices[0].message.role == "assistant"
        assert reply.usage.completion_tokens == len(expected)
    # a template without a `developer` role is given that message as `system`, as training gives it
    as_developer = [{**messages[0], "role": "developer"}, messages[1]]
    reply = api.chat.completions.create(model="med", messages=as_developer, max_tokens=MAX_TOKENS, temperature=0)
    assert reply.usage.prompt_tokens == len(chat_prompt_ids(reference.tokenizer, messages))
    completion = api.completions.create(model="legal", prompt=PROMPTS[3], max_tokens=MAX_TOKENS, temperature=0)
    expected = greedy(reference, "legal", prompt_ids(reference.tokenizer, PROMPTS[3]))
    assert completion.choices[0].text == reference.tokenizer.decode(expected, skip_special_tokens=True)
    assert [model.id for model in api.models.list()] == [BASE_NAME, "legal", "med"]


def test_concurrent_requests_share_forwards_and_match_alone(client, reference):
    jobs = [(model, prompt) for model in (BASE_NAME, "legal", "med") for prompt in PROMPTS[1:3]]
    before = client.get("/stats").json()["forwards_by_model_count"].get("3", 0)
    with ThreadPoolExecutor(len(jobs)) as pool:
        choices = list(pool.map(lambda job: complete(client, *job), jobs))
    stats = client.get("/stats").json()
    assert stats["forwards_by_model_count"].get("3", 0) > before  # base, legal and med rows in one forward
    assert stats["max_rows_per_forward"] >= 3
    for (model, prompt), choice in zip(jobs, choices):
        assert choice["token_ids"] == greedy(reference, adapter_of(model), prompt_ids(reference.tokenizer, prompt))


def test_requests_join_and_leave_a_running_batch(client, reference):
    """Rows join a batch that is decoding (padded cache) and leave it at different steps (trimmed cache)."""
    stats = lambda: client.get("/stats").json()
    joins_before = stats()["joins"]
    with ThreadPoolExecutor(8) as pool:
        long = pool.submit(complete, client, "med", PROMPTS[3], max_tokens=MAX_TOKENS_LIMIT)
        deadline = time.monotonic() + 60
        while stats()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        jobs = [("legal", PROMPTS[2], 3), (BASE_NAME, PROMPTS[0], 9), ("med", PROMPTS[1], 5), ("legal", PROMPTS[3], 12)]
        choices = list(pool.map(lambda job: complete(client, job[0], job[1], max_tokens=job[2]), jobs))
        jobs.append(("med", PROMPTS[3], MAX_TOKENS_LIMIT))
        choices.append(long.result())
    assert stats()["joins"] > joins_before
    for (model, prompt, max_tokens), choice in zip(jobs, choices):
        expected = greedy(reference, adapter_of(model), prompt_ids(reference.tokenizer, prompt), max_tokens)
        assert choice["token_ids"] == expected, (model, prompt, max_tokens)


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(client):
    sampled = dict(temperature=0.9, top_p=0.9, top_k=50, seed=7)
    alone = complete(client, "legal", PROMPTS[0], **sampled)["token_ids"]
    with ThreadPoolExecutor(3) as pool:
        others = [pool.submit(complete, client, model, PROMPTS[1]) for model in ("med", BASE_NAME)]
        batched = complete(client, "legal", PROMPTS[0], **sampled)["token_ids"]
        [other.result() for other in others]
    assert batched == alone
    assert complete(client, "legal", PROMPTS[0], **{**sampled, "seed": 8})["token_ids"] != alone


@pytest.mark.parametrize("extreme", [{"temperature": 1e-40}, {"temperature": 1.0, "top_p": 1e-300}])
def test_a_near_greedy_request_samples_the_best_token_and_spares_its_batch(client, reference, extreme):
    """A temperature or top_p this close to 0 (both in the API's range) leaves only the best token: the answer
    is the greedy one. They made the probabilities NaN, a 500 for the request and for the rows sharing its
    prefill, here a greedy request of another adapter."""
    jobs = [("legal", PROMPTS[0], {"seed": 3, **extreme}), ("med", PROMPTS[1], {})]
    with ThreadPoolExecutor(len(jobs)) as pool:
        choices = list(pool.map(lambda job: complete(client, job[0], job[1], **job[2]), jobs))
    for (model, prompt, _), choice in zip(jobs, choices):
        assert choice["token_ids"] == greedy(reference, model, prompt_ids(reference.tokenizer, prompt))


def test_streaming_returns_the_same_text(client, reference):
    body = {"model": "legal", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [httpx.Response(200, content=line.removeprefix("data: ")).json() for line in lines[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"text_completion"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    expected = greedy(reference, "legal", prompt_ids(reference.tokenizer, PROMPTS[0]))
    text = reference.tokenizer.decode(expected, skip_special_tokens=True)
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == text

    api = openai.OpenAI(base_url=client.base_url.join("/v1").__str__(), api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": PROMPTS[3]}]
    stream = api.chat.completions.create(
        model="med", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream]
    expected = greedy(reference, "med", chat_prompt_ids(reference.tokenizer, messages))
    assert "".join(pieces) == reference.tokenizer.decode(expected, skip_special_tokens=True)


def test_stop_sequence_cuts_the_text(client, reference):
    expected = reference.tokenizer.decode(greedy(reference, "legal", prompt_ids(reference.tokenizer, PROMPTS[2])))
    stop = next(expected[i : i + 2] for i in range(3, len(expected) - 2) if "\ufffd" not in expected[i : i + 2])
    choice = complete(client, "legal", PROMPTS[2], stop=[stop])
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == expected[: expected.find(stop)]


@pytest.mark.parametrize("stop", ["k\u0533 up", "\u0533"])
def test_a_stop_sequence_is_found_where_a_character_spans_tokens(tiny_tokenizer, stop):
    """The byte-level tokenizer writes "\u0533" as two tokens: after the first the text ends in U+FFFD. The "k"
    before it, which begins the stop, was released then, and the stop, whole one token later, was never found."""
    from finetune.serve.textstream import TextStream

    ids = tiny_tokenizer.encode(" rank\u0533 update", add_special_tokens=False)
    texts = [tiny_tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    assert any(text.endswith("k\ufffd") for text in texts)  # the case: a character split across two tokens
    stream = TextStream(lambda tokens: tiny_tokenizer.decode(tokens, skip_special_tokens=True), stop=[stop])
    pieces = []
    for token in ids:
        pieces.append(stream.push(token))
        if stream.stopped:
            break
    pieces.append(stream.finish())
    assert stream.stopped
    assert "".join(pieces) == stream.text == " rank\u0533 update"[: " rank\u0533 update".find(stop)]


# ---- adapters at runtime ---------------------------------------------------------------------------
def test_load_and_unload_at_runtime(client, reference, serve_adapters):
    loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "code", "lora_path": str(serve_adapters["code"])})
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    assert "code" in [card["id"] for card in client.get("/v1/models").json()["data"]]
    with ThreadPoolExecutor(1) as pool:  # unloading waits for the running request of that adapter to finish
        running = pool.submit(complete, client, "code", PROMPTS[0], max_tokens=MAX_TOKENS_LIMIT)
        deadline = time.monotonic() + 60
        while client.get("/stats").json()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "code"})
        choice = running.result()
    assert unloaded.status_code == 200 and "removed successfully" in unloaded.text
    expected = greedy(reference, "code", prompt_ids(reference.tokenizer, PROMPTS[0]), MAX_TOKENS_LIMIT)
    assert choice["token_ids"] == expected
    assert_error(client.post("/v1/completions", json={"model": "code", "prompt": "x"}), 404, "'code' does not exist")
    assert_still_serves(client, reference)


def test_a_row_with_nan_scores_fails_alone_and_spares_its_batch(client, reference, serve_adapters):
    """An adapter whose update overflows gives NaN scores: sampled, its row raised in the sampler and failed every
    request sharing its forward with a 500; greedy, it answered token 0 after token 0. Now only its rows fail."""
    body = {"lora_name": "overflowing", "lora_path": str(serve_adapters["overflowing"])}
    assert client.post("/v1/load_lora_adapter", json=body).status_code == 200
    try:
        jobs = [("overflowing", 1.0), ("legal", 0.0), ("overflowing", 0.0), (BASE_NAME, 0.0)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            send = lambda job: client.post(
                "/v1/completions",
                json={"model": job[0], "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": job[1],
                      "return_token_ids": True},
            )  # fmt: skip
            responses = list(pool.map(send, jobs))
        for (model, _), response in zip(jobs, responses):
            if model == "overflowing":
                assert assert_error(response, 500, "gave NaN or infinite scores")["code"] == "non_finite_logits"
            else:
                assert response.status_code == 200, response.text
                expected = greedy(reference, adapter_of(model), prompt_ids(reference.tokenizer, PROMPTS[1]))
                assert response.json()["choices"][0]["token_ids"] == expected
    finally:
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "overflowing"}).status_code == 200
    assert_still_serves(client, reference)


@pytest.mark.parametrize(
    ("name", "adapter", "status", "fragment"),
    [
        ("alien", "foreign", 400, "was trained on base"),
        ("pickled", "pickled", 400, "pickle file"),
        # peft dropped its up_proj weights: served as the base there, where merging it applied them
        ("untargeted", "untargeted", 400, "which the target_modules of its adapter_config.json do not name"),
        ("legal", "code", 400, "already loaded"),
        (BASE_NAME, "code", 400, "the base model's name"),
        ("bad/name", "code", 400, "adapter name 'bad/name' is invalid"),
        # no name: it was read under its manifest's name ("code"), which stayed listed, every request of it a 500
        ("", "code", 400, "adapter name '' is invalid"),
        ("nowhere", None, 400, "is not an adapter directory"),
    ],
)
def test_load_refusals(client, reference, serve_adapters, tmp_path, name, adapter, status, fragment):
    path = str(serve_adapters[adapter]) if adapter else str(tmp_path / "missing")
    served = client.get("/v1/models").json()["data"]
    response = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
    assert_error(response, status, fragment)
    assert client.get("/v1/models").json()["data"] == served  # nothing half-loaded, what was served unchanged
    assert_still_serves(client, reference)


def test_unloading_an_adapter_frees_the_tokens_of_the_tokenizer_it_carried(
    server, client, reference, serve_adapters, tmp_path
):
    """Each unload gives back what the engine built for the adapter's own tokenizer (`Engine.tokens`: tokenizer,
    stops, reply parser): kept after the unload, loading and unloading under fresh names grew the server by one
    tokenizer a name, without bound. (`chat_turns`' probes keep the last few tokenizers they saw, a bounded cache.)"""
    from transformers import AutoTokenizer

    carried = shutil.copytree(serve_adapters["code"], tmp_path / "carried")
    AutoTokenizer.from_pretrained(reference.base_source).save_pretrained(carried)
    for cycle in range(2):
        name = f"carried-{cycle}"
        loaded = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(carried)})
        assert loaded.status_code == 200, loaded.text
        assert len(complete(client, name, PROMPTS[0])["token_ids"]) == MAX_TOKENS
        tokens = weakref.ref(server.engine.tokens(name))
        assert tokens().tokenizer is not server.engine.loaded.base_tokenizer
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200
        gc.collect()
        assert tokens() is None, f"the tokens of {name}'s tokenizer outlived its unload"
    assert_still_serves(client, reference)


def test_unload_refusals(client, reference):
    assert_error(client.post("/v1/unload_lora_adapter", json={"lora_name": "ghost"}), 404, "no LoRA adapter")
    assert_error(client.post("/v1/unload_lora_adapter", json={"lora_name": BASE_NAME}), 400, "base model")
    assert_still_serves(client, reference)


# ---- limits and errors -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "status", "fragment", "param"),
    [
        ({"model": "nope", "prompt": "x"}, 404, "'nope' does not exist", "model"),
        ({"model": "legal", "prompt": "x", "max_tokens": -1}, 400, "greater than or equal to 1", "max_tokens"),
        (
            {"model": "legal", "prompt": "x", "max_tokens": MAX_TOKENS_LIMIT + 1},
            400,
            "--max-tokens-limit",
            "max_tokens",
        ),
        ({"model": "legal", "prompt": "loss " * 2000}, 400, "context is", "prompt"),
        ({"model": "legal", "prompt": "x", "temperature": -0.5}, 400, "temperature", "temperature"),
        ({"model": "legal", "prompt": "x", "n": 2}, 400, "supports only 1", "n"),
        ({"model": "legal", "prompt": "x", "tools": []}, 400, "does not support this parameter", "tools"),
        # more prompts than may ever be in flight: a 429 would have the client retry what can never fit
        ({"model": "legal", "prompt": ["x"] * (MAX_PENDING + 1)}, 400, "more than --max-pending", "prompt"),
        ({"model": "legal", "prompt": "x", "logprobs": 0}, 400, "supports only false or null", "logprobs"),
        ({"model": "legal", "prompt": "x", "n": True}, 400, "supports only 1", "n"),
        ({"model": "legal", "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream: true", None),
        ({"prompt": "x"}, 400, "Field required", "model"),
        ({"model": "legal", "prompt": "x", "max_tokens": True}, 400, "valid integer", "max_tokens"),
        ({"model": "legal", "prompt": [True]}, 400, "token ids (a list of integers)", "prompt"),
        ({"model": "legal", "prompt": [[]]}, 400, "none of them empty", "prompt"),
        ({"model": "legal", "prompt": [1, 10**9]}, 400, "token id 1000000000 is not in the vocabulary", "prompt"),
        # a field of two forms: pydantic's path named the first form (`stop.str`)
        ({"model": "legal", "prompt": "x", "stop": ["a", 5]}, 400, "stop: give a string or a list of strings", "stop"),
    ],
)
def test_bad_requests_are_refused_and_the_server_goes_on(client, reference, body, status, fragment, param):
    assert_error(client.post("/v1/completions", json=body), status, fragment, param=param)
    assert_still_serves(client, reference)


def test_bad_json_unknown_routes_and_chat_errors(client, reference):
    assert_error(client.post("/v1/completions", content=b'{"model": "legal",'), 400, "not valid JSON")
    assert_error(client.post("/v1/completions", content=b"[1, 2]"), 400, "JSON object")
    assert_error(client.get("/v1/nothing-here"), 404, "Not Found")
    chat = {"model": "med", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    assert_error(client.post("/v1/chat/completions", json=chat), 400)
    assert_error(client.post("/v1/chat/completions", json={"model": "med", "messages": []}), 400, param="messages")
    no_content = {"model": "med", "messages": [{"role": "user"}]}  # was rendered as an empty turn
    assert_error(
        client.post("/v1/chat/completions", json=no_content), 400, "Field required", param="messages.0.content"
    )
    for content in (None, 5, [{"type": "text", "text": 5}]):  # pydantic's path named a form: content.str
        wrong = {"model": "med", "messages": [{"role": "user", "content": content}]}
        error = assert_error(client.post("/v1/chat/completions", json=wrong), 400, param="messages.0.content")
        assert error["message"] == 'messages.0.content: give a string or a list of {"type": "text", "text": ...} parts'
    assert_still_serves(client, reference)


def test_one_model_is_retrieved_by_its_id(server, client):
    """GET /v1/models/{id}, what `client.models.retrieve` asks for (it was a 404 for every id)."""
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert api.models.retrieve("legal").id == "legal"
    assert client.get("/v1/models/legal").json() == next(
        card for card in client.get("/v1/models").json()["data"] if card["id"] == "legal"
    )
    assert_error(client.get("/v1/models/ghost"), 404, "'ghost' does not exist")


def test_a_lone_surrogate_escape_is_a_400_not_a_500(client, reference):
    """ "\\ud800" is valid JSON but no text: the tokenizer raised TypeError on it, a 500 "internal error"."""
    chat = b'{"model": "med", "messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}'
    assert_error(client.post("/v1/chat/completions", content=chat), 400, "lone surrogate")
    completion = b'{"model": "legal", "prompt": "\\udc80 x", "max_tokens": 2}'
    assert_error(client.post("/v1/completions", content=completion), 400, "lone surrogate")
    assert_still_serves(client, reference)


def test_a_dora_adapter_is_refused_rather_than_failing_every_forward_it_joins(
    client, reference, serve_base, tmp_path, capsys
):
    """peft's mixed batches refuse DoRA ("Cannot pass `adapter_names` when DoRA is enabled"): served anyway,
    each request for it was a 500, and so was every request of another model that shared its prefill."""
    dora = make_adapter(serve_base, tmp_path / "dora", seed=15, use_dora=True)
    body = {"lora_name": "dora", "lora_path": str(dora)}
    assert_error(client.post("/v1/load_lora_adapter", json=body), 400, "uses DoRA", param="lora_path")
    assert "dora" not in [card["id"] for card in client.get("/v1/models").json()["data"]]
    assert_still_serves(client, reference)
    assert main(["serve", str(serve_base), "--port", "0", "--adapter", f"dora={dora}"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "uses DoRA" in errors[0], errors


def test_a_gone_client_stops_its_generation_and_shutdown_ends_open_streams(serve_base):
    """A non-streamed request whose client timed out ran on to max_tokens for nobody; and a shutdown waited
    for open requests without limit (the CLI gave up after 30 s and died of SIGABRT, 134)."""
    settings = ServeSettings(base=str(serve_base), base_name=BASE_NAME, port=0, max_tokens_limit=1000, max_pending=2)
    server = ServerThread(settings).start()
    try:
        server.engine.stop_token_ids = frozenset()  # no EOS: only max_tokens or a disconnect ends a row
        step = server.engine.step
        server.engine.step = lambda batch, tokens: (time.sleep(0.02), step(batch, tokens))[1]  # 500 steps: 10 s+
        body = {"model": BASE_NAME, "prompt": "loss", "max_tokens": 500, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 10
        while (stats := httpx.get(server.url + "/stats").json())["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats["running"] == 0 and stats["sequences_finished"] == 0 and stats["decode_steps"] < 400, stats

        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as reply:
            lines = reply.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
            crowded = {**body, "prompt": ["a", "b"], "max_tokens": 1}  # fits --max-pending 2, not beside the stream
            assert_error(httpx.post(server.url + "/v1/completions", json=crowded, timeout=30), 429, "retry later")
            started = time.monotonic()
            server.stop(grace_s=0.2)
            rest = [line for line in lines if line]
        assert not server.running and time.monotonic() - started < 20
        assert rest[-1] == "data: [DONE]" and '"shutting_down"' in rest[-2], rest[-3:]
    finally:
        server.stop(grace_s=0.2)


def test_merged_mode_swaps_exactly_and_needs_the_key(serve_base, serve_adapters, reference):
    settings = ServeSettings(
        base=str(serve_base),
        adapters={"legal": str(serve_adapters["legal"]), "med": str(serve_adapters["med"])},
        base_name=BASE_NAME,
        merge="legal",
        port=0,
        api_key="secret",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merged_reference = finetune.load_model(serve_base, {n: serve_adapters[n] for n in ("legal", "med")})
    merged_reference.merge("legal")
    ids = prompt_ids(reference.tokenizer, PROMPTS[2])
    with ServerThread(settings) as server, httpx.Client(base_url=server.url, timeout=120) as anonymous:
        assert_error(anonymous.get("/v1/models"), 401, "Authorization: Bearer")
        wrong = anonymous.get("/v1/models", headers={"Authorization": "Bearer guess"})
        assert_error(wrong, 401)
        client = httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": "Bearer secret"})
        assert [card["id"] for card in client.get("/v1/models").json()["data"]] == ["legal"]
        assert complete(client, "legal", PROMPTS[2])["token_ids"] == greedy(merged_reference, None, ids)
        assert_error(client.post("/v1/completions", json={"model": BASE_NAME, "prompt": "x"}), 404, "merged")
        assert_error(client.post("/v1/unload_lora_adapter", json={"lora_name": "legal"}), 400, "merged")

        swapped = client.post(
            "/v1/load_lora_adapter", json={"lora_name": "med", "lora_path": str(serve_adapters["med"])}
        )
        assert swapped.status_code == 200, swapped.text
        merged_reference.swap("legal", "med")
        assert complete(client, "med", PROMPTS[2])["token_ids"] == greedy(merged_reference, None, ids)
        assert_error(client.post("/v1/completions", json={"model": "legal", "prompt": "x"}), 404)
        client.close()


# ---- the command line ------------------------------------------------------------------------------
def test_cli_serve_answers_as_the_finetune_generate_subprocess(serve_base, serve_adapters, reference):
    """Both commands as real subprocesses, run side by side (each spends seconds importing torch)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    finetune_command = [sys.executable, "-m", "finetune"]
    serve = [*finetune_command, "serve", str(serve_base), "--adapter", f"med={serve_adapters['med']}", "--port", "0"]
    process = subprocess.Popen(serve, stderr=subprocess.PIPE, env=env, text=True)
    try:
        generate = [*finetune_command, "generate", "--base", str(serve_base), "--adapter", str(serve_adapters["med"])]
        generated = subprocess.run(
            [*generate, "--chat", "--max-new-tokens", str(MAX_TOKENS), PROMPTS[1]], capture_output=True, env=env
        )
        assert generated.returncode == 0, generated.stderr.decode()[-2000:]
        seen = []  # stderr up to the line saying where it serves (model loading may print before it)
        while not (seen and seen[-1].startswith("finetune serve: ")) and (line := process.stderr.readline()):
            seen.append(line)
        assert seen[-1].startswith("finetune serve: http://127.0.0.1:"), seen
        with httpx.Client(base_url=seen[-1].split()[2].removesuffix("/v1"), timeout=120) as client:
            assert [card["id"] for card in client.get("/v1/models").json()["data"]] == [str(serve_base), "med"]
            body = {"model": "med", "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": MAX_TOKENS}
            reply = client.post("/v1/chat/completions", json={**body, "temperature": 0}).json()
        assert generated.stdout.decode("utf-8") == reply["choices"][0]["message"]["content"] + "\n"
        process.send_signal(signal.SIGINT)  # uvicorn shuts down gracefully, then the CLI exits as interrupted
        assert process.wait(timeout=60) == 130
        assert "Traceback" not in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()


BANNER = "finetune serve: http://"
LOADING = "loading "


def stderr_until(process: subprocess.Popen, wanted: str) -> list[str]:
    """stderr lines of `process` up to the first that starts with `wanted` or with the banner (which a
    server that never says `wanted` reaches), or all of them if it ends first."""
    seen: list[str] = []
    while not (seen and seen[-1].startswith((wanted, BANNER))) and (line := process.stderr.readline()):
        seen.append(line)
    return seen


@pytest.mark.parametrize(
    ("moment", "signal_number"),
    [
        ("loading", signal.SIGINT),  # importing torch and loading the models
        ("idle", signal.SIGINT),  # after answering a request
        ("idle", signal.SIGTERM),
    ],
)
def test_cli_serve_exits_128_plus_the_signal_whenever_it_comes(serve_base, moment, signal_number):
    """A real `finetune serve` that inherits SIGINT and SIGTERM ignored, as a shell starts a background job
    (`trap '' INT TERM` here). uvicorn's own handling restored the inherited handler after its graceful
    shutdown and re-raised the signal into it, so such a server exited 0, or never stopped when the
    signal came before uvicorn had installed its handlers. (With the default handlers the existing test
    above sees 130.)"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    serve = [sys.executable, "-m", "finetune", "serve", str(serve_base), "--port", "0"]
    process = subprocess.Popen(
        ["sh", "-c", 'trap "" INT TERM; exec "$@"', "sh", *serve], stderr=subprocess.PIPE, env=env, text=True
    )
    try:
        seen = stderr_until(process, LOADING if moment == "loading" else BANNER)
        assert seen and seen[-1].startswith(LOADING if moment == "loading" else BANNER), seen
        if moment == "idle":
            with httpx.Client(base_url=seen[-1].split()[2].removesuffix("/v1"), timeout=120) as client:
                assert client.get("/v1/models").status_code == 200
        process.send_signal(signal_number)
        assert process.wait(timeout=60) == 128 + signal_number
        rest = process.stderr.read()
        assert "Traceback" not in rest
        assert BANNER not in rest  # a signal while loading: it stops once loaded, without serving
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        (["--adapter", "legal=/nonexistent/adapter"], "is not an adapter directory"),
        (["--adapter", "legal={legal}", "--merge", "med"], "--merge med: no adapter of that name"),
        (["--adapter", "legal={foreign}"], "was trained on base"),
        (["--adapter", "legal={legal}", "--adapter", "legal={med}"], "given twice"),
        (["--adapter", "{legal}", "--base-name", "legal"], "the base model's name"),
    ],
)
def test_cli_startup_errors_are_one_line(serve_base, serve_adapters, capsys, arguments, fragment):
    paths = {name: str(path) for name, path in serve_adapters.items()}
    assert main(["serve", str(serve_base), "--port", "0", *[a.format(**paths) for a in arguments]]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and fragment in errors[0], errors


@pytest.mark.parametrize("spec", ["legal=", "={legal}"])
def test_an_adapter_spec_missing_its_name_or_path_is_refused(serve_adapters, spec):
    """`legal=` was read as the current directory (and a server started there), `=PATH` served under the
    manifest's name. Checked on the parser of the specs: a server that started would never return."""
    from finetune.commands.serve import _adapter_specs
    from finetune.errors import ServeError

    spec = spec.format(legal=serve_adapters["legal"])
    with pytest.raises(ServeError, match=f"--adapter {re.escape(spec)}: give NAME=PATH with both parts"):
        _adapter_specs([spec])


@pytest.mark.parametrize("wait", ["nan", "inf"])
def test_cli_refuses_a_wait_that_never_ends(serve_base, capsys, wait):
    """nan and inf were taken: the worker spun (nan) or died (inf: OverflowError) waiting to fill its first
    batch, while the server took requests and never answered them."""
    from finetune.cli import build_parser

    with pytest.raises(SystemExit) as exit_:  # parsing alone: taken, the server would start and never end
        build_parser().parse_args(["serve", str(serve_base), "--max-wait-ms", wait])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and f"--max-wait-ms: {wait} must be a finite number of at least 0" in error
    for wait_ms in (float(wait), 1e300):  # the Python API's settings, and a finite wait as good as endless
        with pytest.raises(ServeError, match="--max-wait-ms must be a number of at most 60000"):
            ServeSettings(base=str(serve_base), max_wait_ms=wait_ms).check()


def test_cli_refuses_a_taken_port(serve_base, serve_adapters, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert main(["serve", str(serve_base), "--port", port]) == 2
    assert "cannot listen on 127.0.0.1:" in capsys.readouterr().err


def test_serve_help_lists_the_options():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-m", "finetune", "serve", "--help"], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0
    for option in ("--adapter NAME=PATH", "--merge NAME", "--api-key", "--max-batch-size", "--max-wait-ms"):
        assert option in result.stdout


def test_generate_refuses_a_prompt_that_is_not_utf8(serve_base, capsys):
    """Bytes that are not UTF-8 reach argv as lone surrogates; the tokenizer's TypeError was a traceback (exit 1)."""
    assert main(["generate", "--base", str(serve_base), "--max-new-tokens", "2", "hi \udcff"]) == 2
    assert "not valid UTF-8" in capsys.readouterr().err


def test_generate_stops_where_serve_does_at_the_generation_configs_end_of_turn(serve_base, reference, tmp_path, capsys):
    """Gemma's instruction models end a turn with `<end_of_turn>`, an EOS of the generation config but not the
    tokenizer's: `finetune generate` (the light path for plain text, transformers' for --chat) stopped at the
    tokenizer's EOS alone and printed on past the end of the turn, where `finetune serve` stopped."""
    base = shutil.copytree(serve_base, tmp_path / "base")
    tokenizer = reference.tokenizer
    message = [{"role": "user", "content": PROMPTS[0]}]
    generated = {False: greedy(reference, None, prompt_ids(tokenizer, PROMPTS[0])),
                 True: greedy(reference, None, chat_prompt_ids(tokenizer, message))}  # fmt: skip
    ends = {chat: next(t for i, t in enumerate(ids) if i >= 2 and t not in ids[:i]) for chat, ids in generated.items()}
    config = json.loads((base / "generation_config.json").read_text())
    config["eos_token_id"] = [tokenizer.eos_token_id, *ends.values()]
    (base / "generation_config.json").write_text(json.dumps(config))
    settings = ServeSettings(base=str(base), base_name=BASE_NAME, port=0, max_tokens_limit=MAX_TOKENS_LIMIT)
    with ServerThread(settings) as running, httpx.Client(base_url=running.url, timeout=120) as client:
        for chat, ids in generated.items():
            cut = ids[: ids.index(next(t for t in ids if t in ends.values())) + 1]
            expected = tokenizer.decode(cut, skip_special_tokens=True)  # serve leaves out the stop token's text:
            answered = tokenizer.decode(cut[:-1], skip_special_tokens=True)  # both are "" for a special end of turn
            command = ["generate", "--base", str(base), "--max-new-tokens", str(MAX_TOKENS), PROMPTS[0]]
            assert main([*command, "--chat"] if chat else command) == 0
            assert capsys.readouterr().out == expected + "\n"
            body = {"model": BASE_NAME, "max_tokens": MAX_TOKENS, "temperature": 0}
            if chat:
                served = client.post("/v1/chat/completions", json={**body, "messages": message}).json()
                assert served["choices"][0]["message"]["content"] == answered
            else:
                served = client.post("/v1/completions", json={**body, "prompt": PROMPTS[0]}).json()
                assert served["choices"][0]["text"] == answered
            assert served["choices"][0]["finish_reason"] == "stop" and len(cut) < MAX_TOKENS


END_OF_TURN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_end|>' }}{% else %}{{ eos_token }}{% endif %}{{ '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def test_a_chat_reply_ends_at_its_templates_end_of_turn(serve_base, tmp_path, capsys):
    """A base fine-tuned for chat with its tokenizer's template (a Llama 3.1 or Qwen2.5 base) has the template's
    end of turn in neither the tokenizer's EOS nor the generation config: `generate --chat` and serve's chat
    replies ran on to the token limit. Here a base whose head writes `<|im_end|>` first (its row points along
    the prompt's last hidden state) must stop there, with an empty reply, in both."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(serve_base)
    tokenizer.add_tokens(["<|im_end|>"], special_tokens=True)
    tokenizer.chat_template = END_OF_TURN_TEMPLATE
    closer = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = AutoModelForCausalLM.from_pretrained(serve_base, dtype=torch.float32)
    if closer >= model.config.vocab_size:
        model.resize_token_embeddings(len(tokenizer))
    message = [{"role": "user", "content": PROMPTS[0]}]
    with torch.no_grad():
        last = model.model(torch.tensor([chat_prompt_ids(tokenizer, message)])).last_hidden_state[0, -1]
        model.lm_head.weight[closer] = 50 * last / last.norm()  # tied: the embedding's row, never in the prompt
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    assert closer not in (tokenizer.eos_token_id, model.generation_config.eos_token_id)

    command = ["generate", "--base", str(tmp_path / "base"), "--max-new-tokens", str(MAX_TOKENS), "--chat"]
    assert main([*command, PROMPTS[0]]) == 0
    assert capsys.readouterr().out == "\n"
    settings = ServeSettings(
        base=str(tmp_path / "base"), base_name=BASE_NAME, port=0, max_tokens_limit=MAX_TOKENS_LIMIT
    )
    with ServerThread(settings) as running, httpx.Client(base_url=running.url, timeout=120) as client:
        body = {"model": BASE_NAME, "max_tokens": MAX_TOKENS, "temperature": 0, "messages": message}
        served = client.post("/v1/chat/completions", json=body).json()
    assert served["choices"][0]["finish_reason"] == "stop", served
    assert served["choices"][0]["message"]["content"] == "" and served["usage"]["completion_tokens"] == 1
