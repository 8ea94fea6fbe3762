"""A Hugging Face byte-level BPE tokenizer as GGUF metadata: vocabulary, merges, special tokens, chat template.

llama.cpp does not run the tokenizer's own pre-tokenizer; it reads a name (`tokenizer.ggml.pre`) and
applies its built-in splitting for that name. Its converter guesses the name from a hash of token ids
and refuses tokenizers it has not seen (the embedded base's, any locally trained one). This module
names it from what the tokenizer *is*: `tokenizer.json`'s normalizer and pre-tokenizer are compared with
the configurations whose llama.cpp counterpart splits text the same way (`PRE_TOKENIZERS`; the tests
compare token ids from llama.cpp and from the tokenizer on varied text). Anything else is refused.

Example:
    spec = read_tokenizer(Path("merged/legal"), vocab_size=2048)
    spec.pre_tokenizer   # 'gpt-2'
    write_tokenizer(writer, spec)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import ExportError

PRE_TOKENIZERS = {
    "gpt-2": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
}
"""llama.cpp pre-tokenizer name -> the `tokenizer.json` pre_tokenizer (the keys that matter) it matches.
`gpt-2`: byte-level BPE split by GPT-2's regex, as the embedded base's tokenizer is."""

# Hugging Face's `{% generation %}` markers (for assistant-token masks) are not Jinja; llama.cpp's
# template engine would reject them, and they render nothing, so they are dropped from the GGUF copy.
_GENERATION_TAGS = re.compile(r"{%-?\s*(end)?generation\s*-?%}")

# gguf.TokenType values (llama.cpp's llama_token_type): kept here so reading a tokenizer needs no gguf import.
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5


@dataclass(frozen=True)
class TokenizerSpec:
    """Everything llama.cpp needs to tokenize as the Hugging Face tokenizer does."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    """BPE merges as 'left right' strings, in priority order."""
    pre_tokenizer: str
    special_ids: dict[str, int]
    """bos/eos/pad/unk -> token id, for those the tokenizer has."""
    add_bos: bool
    add_eos: bool
    chat_template: str | None


def _pre_tokenizer_name(spec: dict[str, Any], where: str) -> str:
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ExportError(
            f"{where}: tokenizer model {model.get('type')!r} (byte_fallback={model.get('byte_fallback')}) cannot be "
            "exported to GGUF yet; supported: byte-level BPE"
        )
    if spec.get("normalizer") is not None:
        raise ExportError(f"{where}: tokenizers with a normalizer cannot be exported to GGUF yet")
    for name, expected in PRE_TOKENIZERS.items():
        if all(pre.get(key) == value for key, value in expected.items()):
            return name
    raise ExportError(
        f"{where}: pre-tokenizer {json.dumps(pre)} matches none llama.cpp knows by name; supported: "
        + "; ".join(f"{name} = {json.dumps(expected)}" for name, expected in PRE_TOKENIZERS.items())
    )


def _merges(model: dict[str, Any]) -> list[str]:
    """Merges as 'a b' strings; tokenizers >= 0.20 stores pairs, older versions the strings themselves."""
    return [merge if isinstance(merge, str) else " ".join(merge) for merge in model.get("merges", [])]


def _special_token_flags(tokenizer: Any) -> tuple[bool, bool]:
    """Whether encoding plain text adds BOS first / EOS last, found by encoding a probe."""
    ids = tokenizer("probe", add_special_tokens=True)["input_ids"]
    bare = tokenizer("probe", add_special_tokens=False)["input_ids"]
    add_bos = tokenizer.bos_token_id is not None and len(ids) > len(bare) and ids[0] == tokenizer.bos_token_id
    add_eos = tokenizer.eos_token_id is not None and len(ids) > len(bare) and ids[-1] == tokenizer.eos_token_id
    return add_bos, add_eos


def read_tokenizer(model_dir: Path, vocab_size: int) -> TokenizerSpec:
    """Read the tokenizer of `model_dir` for a model whose embedding has `vocab_size` rows.

    Rows past the tokenizer's vocabulary (embeddings padded to a round size) become unused `[PADn]` tokens.

    Raises:
        ExportError: no tokenizer, or one llama.cpp cannot reproduce (see `PRE_TOKENIZERS`).
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise ExportError(f"{model_dir}: no usable tokenizer ({str(exc).splitlines()[0]})") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ExportError(f"{model_dir}: only fast (tokenizer.json) tokenizers can be exported to GGUF")
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    pre_tokenizer = _pre_tokenizer_name(spec, str(model_dir))

    by_id = {token_id: token for token, token_id in tokenizer.get_vocab().items()}
    if by_id and max(by_id) >= vocab_size:
        raise ExportError(f"{model_dir}: the tokenizer has id {max(by_id)} but the model only {vocab_size} embeddings")
    added = tokenizer.added_tokens_decoder
    tokens, token_types = [], []
    for token_id in range(vocab_size):
        if token_id not in by_id:
            tokens.append(f"[PAD{token_id}]")
            token_types.append(_UNUSED)
        elif token_id in added:
            tokens.append(by_id[token_id])
            token_types.append(_CONTROL if added[token_id].special else _USER_DEFINED)
        else:
            tokens.append(by_id[token_id])
            token_types.append(_NORMAL)

    special_ids = {
        kind: token_id
        for kind in ("bos", "eos", "pad", "unk")
        if (token_id := getattr(tokenizer, f"{kind}_token_id")) is not None
    }
    add_bos, add_eos = _special_token_flags(tokenizer)
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    return TokenizerSpec(
        tokens=tokens,
        token_types=token_types,
        merges=_merges(spec["model"]),
        pre_tokenizer=pre_tokenizer,
        special_ids=special_ids,
        add_bos=add_bos,
        add_eos=add_eos,
        chat_template=_GENERATION_TAGS.sub("", template) if template else None,
    )


def write_tokenizer(writer: Any, spec: TokenizerSpec) -> None:
    """The `tokenizer.ggml.*` and `tokenizer.chat_template` keys of `spec`."""
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre(spec.pre_tokenizer)
    writer.add_token_list(spec.tokens)
    writer.add_token_types(spec.token_types)
    writer.add_token_merges(spec.merges)
    for kind, token_id in spec.special_ids.items():
        getattr(writer, f"add_{kind}_token_id")(token_id)
    writer.add_add_bos_token(spec.add_bos)
    writer.add_add_eos_token(spec.add_eos)
    if spec.chat_template:
        writer.add_chat_template(spec.chat_template)
