"""The model side of `finetune serve`: which models are served, prompts to tokens, and batched forwards.

Two modes over one `LoadedModel` (`finetune.load_model`):
- **per-row adapters** (default): every adapter is attached unmerged, and one forward serves rows of
  different models: peft's mixed-batch inference gives each row its own adapter (`adapter_names`,
  `"__base__"` for base rows), so a row gets what `use(name)` gives it alone. On a mixture of experts
  the expert tensors' LoRA, which peft cannot apply per row, is applied by `adapters.expert_rows`:
  each row's experts compute with the tensors the merged model holds.
- **merged** (`merge=NAME`): one adapter is merged into the weights exactly (`LoadedModel.merge`) and the
  plain model runs, with no LoRA layers in the way; loading another adapter swaps it in exactly
  (`LoadedModel.swap`: the weights then equal a fresh base with that adapter merged). Only that adapter
  is served.

Tokens come from `finetune.prompting`, the rule `finetune generate` uses, so greedy output matches it.
Every method that touches the model runs on the batcher's one worker thread; the `read_*`, `encode_*`
and `check_*` methods only read, and run in request handlers.

Example:
    engine = Engine.load(ServeSettings(base="models/tiny", adapters={"legal": "adapters/legal"}))
    batch = KVBatch.from_prompts([engine.encode_completion("def add")], ["legal"], engine.pad_token_id)
    logits = engine.prefill(batch)            # (1, V) for the next token
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from finetune.adapters.fit import check_fingerprint
from finetune.adapters.inmemory import LoadedModel
from finetune.adapters.lora import Adapter, read_adapter, validate_adapter_name
from finetune.api import load_model
from finetune.data.chat import ChatRecord, normalize_messages, normalize_tools
from finetune.data.chat_turns import chat_turn_closer_ids, render_chat_prompt
from finetune.errors import AdapterError, FinetuneError, ModelError, ServeError
from finetune.generation.kvbatch import KVBatch
from finetune.model import load_adapter_tokenizer
from finetune.prompting import model_stop_token_ids, prompt_ids
from finetune.serve.replies import ReplyParser
from finetune.serve.settings import BASE_ROW, ServeSettings


@dataclass(frozen=True)
class ModelCard:
    """One entry of /v1/models."""

    id: str
    root: str
    parent: str | None


class Engine:
    """A `LoadedModel` served under model names: the base's and one per adapter (or the merged one)."""

    def __init__(self, loaded: LoadedModel, base_name: str, merged: str | None = None):
        self.loaded = loaded
        self.base_name = base_name
        self.merged = merged
        self.created = int(time.time())
        self._tokenizer_lock = threading.Lock()
        tokenizer, config = loaded.base_tokenizer, loaded.model.config
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._base_tokens = ModelTokens.of(loaded.model, tokenizer, frozenset())
        self._tokens: dict[str, ModelTokens] = {}
        self.stop_token_ids = self._base_tokens.stop_token_ids
        """Where every row ends: the model's and the base tokenizer's EOS (`prompting.model_stop_token_ids`)."""
        self.max_model_len = int(getattr(config, "max_position_embeddings", None) or tokenizer.model_max_length)
        for name, adapter in loaded.adapters.items():
            self._check_name(name)
            if merged is None:
                _check_per_row(adapter)
        if merged is not None:
            loaded.merge(merged)
        else:
            for name in loaded.adapters:
                loaded.attach(name)

    @classmethod
    def load(cls, settings: ServeSettings) -> Engine:
        """Load the base and adapters of `settings` (AdapterError/ModelError on a bad path or base)."""
        base = settings.base
        if base is None:  # the first adapter's manifest names the base
            name, path = next(iter(settings.adapters.items()))
            lead = read_adapter(path, name)
            if lead.base_path is None:
                raise ServeError(f"adapter {path} records no base (no manifest, no base_model_name_or_path); pass BASE")
            base = lead.base_path
            base_name = settings.base_name or (lead.manifest.base.id if lead.manifest is not None else base)
        else:
            base_name = settings.base_name or base
        loaded = load_model(base, settings.adapters, dtype=settings.dtype, device=settings.device)
        return cls(loaded, base_name, settings.merge)

    @property
    def device(self) -> torch.device:
        """Where the model runs: every input tensor is built there."""
        return self.loaded.device

    # ---- what is served ----------------------------------------------------------------------------
    def models(self) -> list[ModelCard]:
        """The served models: the base and every adapter, or the merged adapter alone."""
        if self.merged is not None:
            return [ModelCard(self.merged, str(self.loaded.adapters[self.merged].path), self.base_name)]
        adapters = [ModelCard(n, str(a.path), self.base_name) for n, a in sorted(self.loaded.adapters.items())]
        return [ModelCard(self.base_name, str(self.loaded.base_source), None), *adapters]

    def check_model(self, model: str) -> None:
        """Raise a 404 `ServeError` unless `model` is served now."""
        if any(card.id == model for card in self.models()):
            return
        served = ", ".join(card.id for card in self.models())
        hint = (
            f"; this server serves {self.merged!r} merged: swap another adapter in with POST /v1/load_lora_adapter"
            if self.merged is not None
            else ""
        )
        raise ServeError(
            f"the model {model!r} does not exist (served: {served}){hint}",
            status=404,
            param="model",
            code="model_not_found",
        )

    def tokens(self, model: str | None = None) -> ModelTokens:
        """What requests for `model` are encoded, stopped, decoded and read with: the tokenizer of the adapter it
        names where that adapter carries one (its run's, with the chat template it trained with), else the base's
        (None: the base). Their vocabularies are one (`finetune.model.check_same_vocabulary`), so rows of every
        model share a batch, its padding and its logits."""
        tokenizer = self.loaded.tokenizer_for(None if model == self.base_name else model)
        if tokenizer is self.loaded.base_tokenizer:
            return self._base_tokens
        assert model is not None, "the base's tokenizer is the base's tokens"
        known = self._tokens.get(model)
        if known is None or known.tokenizer is not tokenizer:  # the name may be reloaded from another adapter
            known = self._tokens[model] = ModelTokens.of(self.loaded.model, tokenizer, self.stop_token_ids)
        return known

    def stop_ids(self, model: str | None, chat: bool) -> frozenset[int]:
        """What ends a row of `model` besides the engine's `stop_token_ids`: its tokenizer's own EOS (an
        adapter's that is not the base's) and, for a chat reply, its template's end of turn."""
        tokens = self.tokens(model)
        return tokens.extra_stop_ids | (tokens.turn_closer_ids if chat else frozenset())

    # ---- prompts -----------------------------------------------------------------------------------
    # A fast tokenizer is one Rust object: two threads encoding, or one encoding while another decodes,
    # can fail with "RuntimeError: Already borrowed" (transformers #47085, vLLM #40949). One lock serialises them.
    def encode_completion(self, prompt: str | list[int], model: str | None = None) -> list[int]:
        """A text prompt's token ids (by `model`'s tokenizer), or token ids given as the prompt, checked against
        the vocabulary."""
        tokenizer = self.tokens(model).tokenizer
        if isinstance(prompt, list):
            vocabulary = len(tokenizer)
            outside = next((token for token in prompt if not 0 <= token < vocabulary), None)
            if outside is not None:
                raise ServeError(f"prompt: token id {outside} is not in the vocabulary (0 to {vocabulary - 1})",
                                 param="prompt")  # fmt: skip
            return list(prompt)
        with self._tokenizer_lock:
            return prompt_ids(tokenizer, prompt)

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, model: str | None = None
    ) -> list[int]:
        """The prompt ids of a conversation in OpenAI's shape (tool calls, tool results, reasoning) with its
        `tools`, as training renders the same conversation as a prompt (`finetune.data.formats`' rule for GRPO
        and preference prompts: normalised, given to the template in the form it reads, generation prompt last),
        with `model`'s chat template (an adapter's own where it carries a tokenizer, else the base's).

        Raises:
            ServeError: (400, param `messages`) a malformed conversation or a template that cannot render it.
        """
        tokenizer = self.tokens(model).tokenizer
        try:
            if getattr(tokenizer, "chat_template", None) is None:
                raise ModelError(
                    f"the tokenizer of {model or self.base_name!r} has no chat template; send plain text (a "
                    "completion) instead, or serve an adapter trained with data.chat_template"
                )
            schemas = normalize_tools(tools, "request", "tools")
            chat = ChatRecord(normalize_messages(messages, "request", schemas, context_only=True), schemas)
            with self._tokenizer_lock:
                return render_chat_prompt(chat, tokenizer.get_chat_template(), tokenizer, "request")
        except FinetuneError as exc:
            said = str(exc).replace("fix the record", "fix the request").replace("the record's tools", "the tools")
            raise ServeError(said, param="messages") from None

    def decode_raw(self, token_ids: list[int], model: str | None = None) -> str:
        """Text of tokens with special tokens kept: what a reply parser reads (Mistral's `[TOOL_CALLS]` is one)."""
        tokenizer = self.tokens(model).tokenizer
        with self._tokenizer_lock:
            return cast(str, tokenizer.decode(token_ids, skip_special_tokens=False))

    def decode_text(self, token_ids: list[int], model: str | None = None) -> str:
        """Text of generated tokens, as `finetune generate` prints it (special tokens skipped)."""
        tokenizer = self.tokens(model).tokenizer
        with self._tokenizer_lock:
            text = tokenizer.decode(token_ids, skip_special_tokens=True)
        return cast(str, text)  # transformers types decode as str | list[str]; one sequence gives a str

    def check_length(self, prompt_tokens: int, max_tokens: int | None, default: int | None, limit: int) -> int:
        """The number of tokens a request may generate; ServeError (400) when it cannot fit."""
        room = self.max_model_len - prompt_tokens
        if prompt_tokens == 0:
            raise ServeError("the prompt is empty (no tokens)", param="prompt", code="empty_prompt")
        if room <= 0:
            raise ServeError(
                f"the prompt is {prompt_tokens} tokens; this model's context is {self.max_model_len} tokens, and the "
                "prompt plus max_tokens must fit in it; shorten the prompt",
                param="prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return min(default or limit, room, limit)
        if max_tokens > limit:
            raise ServeError(
                f"max_tokens {max_tokens} is more than this server allows ({limit}, set by --max-tokens-limit)",
                param="max_tokens",
                code="max_tokens_too_large",
            )
        if max_tokens > room:
            raise ServeError(
                f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds this model's context of "
                f"{self.max_model_len} tokens; lower max_tokens to at most {room}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    # ---- forwards (worker thread) ------------------------------------------------------------------
    def prefill(self, batch: KVBatch) -> torch.Tensor:
        """Run the prompts of a fresh batch; return the next-token logits (B, V) and advance the batch."""
        assert batch.input_ids is not None, "prefill takes a fresh batch (KVBatch.from_prompts)"
        logits = self._forward(batch.input_ids, batch)
        batch.advance()
        return logits

    def step(self, batch: KVBatch, tokens: list[int]) -> torch.Tensor:
        """Feed one token per row; return the next-token logits (B, V) and advance the batch."""
        logits = self._forward(torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None], batch)
        batch.advance()
        return logits

    def _forward(self, input_ids: torch.Tensor, batch: KVBatch) -> torch.Tensor:
        arguments = dict(input_ids=input_ids, logits_to_keep=1, **batch.forward_kwargs())
        with torch.inference_mode():
            if self.merged is None and self.loaded.attached:
                rows = [BASE_ROW if model == self.base_name else model for model in batch.models]
                output = self.loaded.use_per_row()(**arguments, adapter_names=rows)
            else:
                output = self.loaded.model(**arguments)
        return output.logits[:, -1].float()

    # ---- adapters at runtime -----------------------------------------------------------------------
    def read_new_adapter(self, name: str, path: str) -> NewAdapter | None:
        """Read and check an adapter to load, and the tokenizer it carries (handler thread). None: `name` is loaded
        from `path` already, which in merged mode means "swap it back in".

        Raises:
            ServeError: the name clashes. AdapterError: unreadable, not safetensors, or another base.
            ModelError: its tokenizer's vocabulary is not the base's (`finetune.model.check_same_vocabulary`).
        """
        self._check_name(name)
        known = self.loaded.adapters.get(name)
        if known is not None:
            if self.merged is not None and Path(known.path).resolve() == Path(path).resolve():
                return None
            raise ServeError(
                f"an adapter named {name!r} is already loaded (from {known.path}); unload it first or choose "
                "another lora_name",
                param="lora_name",
                code="adapter_exists",
            )
        adapter = read_adapter(path, name)
        check_fingerprint(adapter, self.loaded.ledger.base_fingerprint, self.base_name, force=False)
        if self.merged is None:
            _check_per_row(adapter)
        return NewAdapter(adapter, load_adapter_tokenizer(adapter.path, self.loaded.base_tokenizer))

    def install(self, name: str, adapter: NewAdapter | None) -> str:
        """Add `adapter` (worker thread): attach it, or in merged mode swap it in. Returns what happened."""
        if adapter is not None:
            self.loaded.add_adapter(adapter.adapter, adapter.tokenizer)
        try:
            if self.merged is None:
                self.loaded.attach(name)
                return f"Success: LoRA adapter '{name}' added successfully."
            if self.merged != name:
                self.loaded.swap(self.merged, name)
                self.merged = name
            return f"Success: LoRA adapter '{name}' merged (serving it now)."
        except Exception:
            if adapter is not None:
                self.loaded.remove_adapter(name)
            raise

    def check_removable(self, name: str) -> None:
        """ServeError unless adapter `name` is loaded and may be unloaded."""
        if name == self.base_name:
            raise ServeError("the base model cannot be unloaded", param="lora_name", code="base_model")
        if name not in self.loaded.adapters:
            raise ServeError(
                f"no LoRA adapter named {name!r} is loaded", status=404, param="lora_name", code="adapter_not_found"
            )
        if name == self.merged:
            raise ServeError(
                f"adapter {name!r} is merged and served; load another adapter to swap it out first",
                param="lora_name",
                code="adapter_merged",
            )

    def remove(self, name: str) -> str:
        """Unload adapter `name` (worker thread, with no row of it running), and forget its `ModelTokens`: kept,
        every name ever loaded held its tokenizer (and reply parser) until the server stopped, so a server that
        loads and unloads adapters under fresh names grew by one tokenizer per name."""
        self.check_removable(name)
        self.loaded.remove_adapter(name)
        self._tokens.pop(name, None)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _check_name(self, name: str) -> None:
        """ServeError (400) for a `lora_name` that cannot name an adapter here. Checked before the adapter is read:
        `read_adapter` names an adapter by its manifest when given no name, so `"lora_name": ""` loaded it under
        its manifest's name and then failed to attach "" (a 400 that left an adapter listed in /v1/models whose
        every request was a 500, failing the rows that shared its prefill)."""
        try:
            validate_adapter_name(name)
        except AdapterError as exc:
            raise ServeError(str(exc), param="lora_name", code="invalid_name") from None
        if name == self.base_name:
            raise ServeError(
                f"adapter name {name!r} is the base model's name; choose another (or rename the base with --base-name)",
                param="lora_name",
                code="name_clash",
            )


@dataclass(frozen=True)
class NewAdapter:
    """An adapter read for `/v1/load_lora_adapter`, and the tokenizer it carries (None: it serves with the base's)."""

    adapter: Adapter
    tokenizer: Any


@dataclass(frozen=True)
class ModelTokens:
    """What one served model's text goes through: its tokenizer and what follows from it."""

    tokenizer: Any
    stop_token_ids: frozenset[int]
    """Where its replies end (`prompting.model_stop_token_ids`)."""
    extra_stop_ids: frozenset[int]
    """Those of `stop_token_ids` that the engine's (the base's) are not: a row of this model carries them."""
    turn_closer_ids: frozenset[int]
    """Where its chat replies also end: its template's end of turn (`chat_turns.turn_closer_ids`)."""
    reply_parser: ReplyParser

    @classmethod
    def of(cls, model: Any, tokenizer: Any, base_stops: frozenset[int]) -> ModelTokens:
        stops = frozenset(model_stop_token_ids(model, tokenizer))
        parser = ReplyParser.for_tokenizer(tokenizer)
        return cls(tokenizer, stops, stops - base_stops, chat_turn_closer_ids(tokenizer), parser)


def _check_per_row(adapter: Adapter) -> None:
    """ServeError for an adapter that peft's mixed batches (`adapter_names`) refuse: DoRA. Served anyway,
    every forward with a row of it raised ("Cannot pass `adapter_names` when DoRA is enabled"): a 500 for
    its requests and for every request that shared their prefill."""
    if adapter.config.get("use_dora"):
        raise ServeError(
            f"adapter {adapter.name!r} ({adapter.path}) uses DoRA, which finetune serve cannot apply per row "
            "(peft's mixed-adapter batches refuse it) nor merge exactly; use finetune generate, or retrain "
            "without lora.use_dora",
            param="lora_path",
            code="adapter_unsupported",
        )
