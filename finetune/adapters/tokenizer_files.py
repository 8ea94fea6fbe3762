"""The tokenizer files an adapter (or a merged model) carries, as files: which they are, and which to pass on.

A training run saves the tokenizer it used, with the chat template it rendered with, beside the adapter
(`tokenizer.save_pretrained`, as trl's trainers do), so that the adapter chats as it was trained even where the
base's tokenizer has another template or none (`data.chat_template`), or where the run used another tokenizer
(`model.tokenizer`). What writes a model or an adapter from adapters passes that tokenizer on: a merged model
directory carries its merged adapters' tokenizer, a combined adapter its inputs'. Two adapters whose tokenizer
files differ have no one tokenizer to pass on; the output then keeps the base's, with a warning.

Loading (the tokenizer object, and the check that its vocabulary is the base's) is `finetune.model`'s part;
this module only reads and copies files, so that the on-disk arithmetic loads no transformers tokenizer. What
an on-disk merge passes on is checked here from the files (`check_vocabulary_files`, the `tokenizers` library
reading tokenizer.json): the merged model's embedding has the base's rows, whatever tokenizer it carries.

Example:
    source = shared_tokenizer_dir([legal, med], "the merged model")   # None: no adapter carries one
    if source is not None:
        copy_tokenizer(source, staging)
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from finetune.adapters.lora import Adapter
from finetune.errors import AdapterError, AdapterWarning

TOKENIZER_CONFIG = "tokenizer_config.json"
"""The file that marks a directory as holding a tokenizer (what `from_pretrained` reads first)."""
TOKENIZER_JSON = "tokenizer.json"
"""A fast tokenizer's vocabulary, merges and special tokens in one file (what `check_vocabulary_files` reads)."""
TOKENIZER_FILES = (
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)
"""What `save_pretrained` of a tokenizer writes (by family), besides `additional_chat_templates/`."""
EXTRA_TEMPLATES = "additional_chat_templates"


def carries_tokenizer(directory: Path) -> bool:
    """Whether `directory` holds a tokenizer saved by `save_pretrained`."""
    return (Path(directory) / TOKENIZER_CONFIG).is_file()


def _contents(directory: Path) -> dict[str, bytes]:
    """The tokenizer files of `directory` by relative name, with their bytes."""
    found = {name: (directory / name).read_bytes() for name in TOKENIZER_FILES if (directory / name).is_file()}
    extra = directory / EXTRA_TEMPLATES
    if extra.is_dir():
        found.update({f"{EXTRA_TEMPLATES}/{p.name}": p.read_bytes() for p in sorted(extra.iterdir()) if p.is_file()})
    return found


def shared_tokenizer_dir(adapters: Iterable[Adapter], output: str) -> Path | None:
    """The directory of the tokenizer the adapters carry, for `output` to carry it: None where none carries one,
    or (with an `AdapterWarning`) where two carry different ones (an adapter without one takes no part)."""
    carrying = [a for a in adapters if carries_tokenizer(a.path)]
    if not carrying:
        return None
    first = _contents(carrying[0].path)
    other = next((a for a in carrying[1:] if _contents(a.path) != first), None)
    if other is None:
        return carrying[0].path
    warnings.warn(
        f"adapters {carrying[0].name!r} and {other.name!r} carry different tokenizers (another chat template or "
        f"vocabulary); {output} gets the base's tokenizer: copy the one to use into it",
        AdapterWarning,
        stacklevel=3,
    )
    return None


def copy_tokenizer(source: Path, out_dir: Path) -> None:
    """Make `out_dir`'s tokenizer files `source`'s: those `out_dir` holds are removed first, so that no file of
    another tokenizer (a base's `tokenizer.model` beside an adapter's `tokenizer.json`) is left to mix in."""
    for name in TOKENIZER_FILES:
        (out_dir / name).unlink(missing_ok=True)
    shutil.rmtree(out_dir / EXTRA_TEMPLATES, ignore_errors=True)
    for name in _contents(Path(source)):
        (out_dir / name).parent.mkdir(exist_ok=True)
        shutil.copy2(Path(source) / name, out_dir / name)


def _tokenizer(directory: Path) -> Any:
    """The `tokenizers.Tokenizer` of the tokenizer.json in `directory`; None without one (a slow tokenizer's files
    alone: nothing to compare here, `finetune.model.check_same_vocabulary` checks it where it is loaded)."""
    if not (directory / TOKENIZER_JSON).is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(directory / TOKENIZER_JSON))


def _specials(tokenizer: Any) -> set[str]:
    return {token.content for token in tokenizer.get_added_tokens_decoder().values() if token.special}


def check_vocabulary_files(carried: Path, base_dir: Path, output: str) -> None:
    """Refuse to give `output` the tokenizer `carried` (an adapter's) where its ids are not the base's: another
    number of tokens, or a special token of either at another id, the test `finetune.model.check_same_vocabulary`
    makes where an adapter is loaded. An on-disk merge copied it unchecked, and the merged model then held a
    tokenizer whose ids its embedding has no rows for (an index error in transformers).

    Raises:
        AdapterError: the vocabularies differ (both read from their tokenizer.json files).
    """
    ours, base = _tokenizer(Path(carried)), _tokenizer(Path(base_dir))
    if ours is None or base is None:
        return
    fix = f"delete the tokenizer files from {carried} to give {output} the base's, or merge into the base it was trained on"
    sizes = ours.get_vocab_size(with_added_tokens=True), base.get_vocab_size(with_added_tokens=True)
    if sizes[0] != sizes[1]:
        raise AdapterError(f"the tokenizer of {carried} has {sizes[0]:,} tokens but the base's has {sizes[1]:,}; {fix}")
    for token in sorted(_specials(ours) | _specials(base)):
        ids = ours.token_to_id(token), base.token_to_id(token)
        if ids[0] != ids[1]:
            raise AdapterError(
                f"the tokenizer of {carried} has special token {token!r} at id {ids[0]} but the base's at {ids[1]}; {fix}"
            )
