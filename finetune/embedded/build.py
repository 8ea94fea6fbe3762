"""How an embedded base is made: corpus → tokenizer → tiny Llama → brief pretraining → model directory.

`EMBEDDED_BASES` (from `finetune.embedded.settings`) names every embedded base and the settings it is built
from. `build_embedded_base` writes a normal Hugging Face model directory (config.json, model.safetensors,
generation_config.json, tokenizer files) plus `embedded.json`, a record of how it was built. The same
settings on the same Python and torch give the same weights, bit for bit. Where the directory lives and when it is (re)built
is `finetune.embedded`'s job.

Example:
    record = build_embedded_base(Path("/tmp/tiny"), EMBEDDED_BASES["tiny-llama"], progress=print)
    record["pretraining"]["final_loss"]
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import transformers
from transformers.utils import logging as hf_logging

from finetune.atomic import remove_directory
from finetune.embedded.corpus import stdlib_corpus
from finetune.embedded.pretrain import PretrainResult, pretrain, token_rows
from finetune.embedded.settings import (
    BUILD_FORMAT_VERSION,
    EMBEDDED_BASES,
    BuildSettings,
    settings_record,
)
from finetune.embedded.shipped import (
    FINGERPRINTED_FILES,
    RECORD_FILE,
    check_shipped_base,
    file_sha256,
    shipped_base_dir,
)
from finetune.embedded.synthetic import copy_score, synthetic_rows
from finetune.embedded.tiny import build_tiny_llama, wire_previous_token_head
from finetune.embedded.tokenizer import train_tokenizer
from finetune.errors import ModelError


def _synthetic_rows(tokenizer, settings: BuildSettings, num_corpus_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic rows mixed into pretraining: `synthetic_fraction` of all training rows."""
    fraction = settings.synthetic_fraction
    num_rows = round(num_corpus_rows * fraction / (1.0 - fraction))
    return synthetic_rows(tokenizer, num_rows, settings.seq_len, seed=settings.init_seed)


def _pretrain_on_threads(
    model, tokenizer, rows, extra_rows, settings: BuildSettings, num_threads: int, progress: Callable[[str], None]
) -> tuple[PretrainResult | None, PretrainResult, float]:
    """Pretrain on `num_threads` torch threads (then restore the caller's).

    Returns:
        The copy curriculum's result (None without one), the main pretraining's, and the final copy score.
    """
    threads_before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        probe = lambda: f", copy score {copy_score(model, tokenizer):.3f}"
        curriculum, curriculum_result = settings.copy_curriculum, None
        if curriculum is not None:
            num_rows = curriculum.steps * curriculum.micro_batch_size
            repeats = synthetic_rows(tokenizer, num_rows, settings.seq_len, seed=settings.init_seed + 1, recall=False)
            progress(f"copy curriculum: {curriculum.steps} steps on repeated random segments alone")
            curriculum_result = pretrain(model, rows, curriculum, progress, repeats, probe, train_on_rows=False)
            model.train()
        result = pretrain(model, rows, settings.pretraining, progress, extra_rows, probe)
        return curriculum_result, result, copy_score(model, tokenizer)
    finally:
        torch.set_num_threads(threads_before)


def _initial_model(tokenizer, settings: BuildSettings) -> transformers.PreTrainedModel:
    """The randomly initialised model, with its wired previous-token head if the settings ask for one."""
    model = build_tiny_llama(tokenizer, seed=settings.init_seed, **settings.shape)
    if settings.previous_token_head:
        wire_previous_token_head(model)
    return model


def _available_cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _save_quietly(model: transformers.PreTrainedModel, tokenizer, out_dir: Path) -> None:
    """`save_pretrained` of model (safetensors, config.json, generation_config.json) and tokenizer."""
    progress_bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-shard "Writing model shards" bar says nothing in our log
    try:
        model.save_pretrained(out_dir)
    finally:
        if progress_bar_was_enabled:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(out_dir)


def build_embedded_base(
    out_dir: Path,
    settings: BuildSettings,
    progress: Callable[[str], None] = lambda message: None,
) -> dict:
    """Build a base into `out_dir` (which must exist and be empty) and return its build record.

    Args:
        out_dir: the directory to write; `finetune.embedded.cache` passes a temporary one and renames it.
        settings: corpus size, tokenizer, shape and pretraining.
        progress: called with one-line progress messages.
    """
    start_seconds = time.perf_counter()
    corpus = stdlib_corpus(settings.corpus_max_bytes, settings.corpus_file_max_bytes)
    progress(f"corpus: {corpus.num_files} files, {corpus.num_bytes / 1e6:.1f} MB of {corpus.source}")

    tokenizer = train_tokenizer(
        corpus.documents, vocab_size=settings.vocab_size, max_model_len=int(settings.shape["max_position_embeddings"])
    )
    rows = token_rows(tokenizer, corpus.documents, settings.seq_len)  # (num_rows, seq_len)
    extra_rows = _synthetic_rows(tokenizer, settings, num_corpus_rows=len(rows) - settings.pretraining.heldout_rows)
    tokenizer_seconds = time.perf_counter() - start_seconds
    progress(
        f"tokenizer: {len(tokenizer)} tokens; corpus is {rows.numel():,} tokens"
        f" + {extra_rows[0].numel():,} synthetic ({tokenizer_seconds:.0f} s)"
    )

    model = _initial_model(tokenizer, settings)
    num_params = sum(p.numel() for p in model.parameters())
    progress(f"model: {num_params / 1e6:.2f}M parameters; pretraining for {settings.pretraining.steps} steps")
    num_threads = settings.num_threads or _available_cpu_count()
    curriculum, result, copy = _pretrain_on_threads(model, tokenizer, rows, extra_rows, settings, num_threads, progress)

    _save_quietly(model, tokenizer, out_dir)
    record = {
        "format_version": BUILD_FORMAT_VERSION,
        "settings": settings_record(settings),
        "corpus": {
            "source": corpus.source,
            "files": corpus.num_files,
            "bytes": corpus.num_bytes,
            "tokens": rows.numel(),
            "sha256": corpus.sha256,
        },
        "parameters": num_params,
        "synthetic_tokens": extra_rows[0].numel(),
        "copy_curriculum": None if curriculum is None else asdict(curriculum),
        "pretraining": asdict(result),
        "copy_score": copy,
        "seconds": round(time.perf_counter() - start_seconds, 2),
        "threads": num_threads,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }
    record["sha256"] = {name: file_sha256(out_dir / name) for name in FINGERPRINTED_FILES}
    (out_dir / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record


def _build_beside(target: Path, settings: BuildSettings, progress: Callable[[str], None]) -> dict:
    """Build into a fresh directory beside `target`, then put it in `target`'s place (replacing it)."""
    import shutil
    import tempfile

    target.parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    work_dir.chmod(0o755)
    try:
        record = build_embedded_base(work_dir, settings, progress)
        if target.exists():
            remove_directory(target)  # out of view first: never a half-deleted base in view
        os.rename(work_dir, target)
    except BaseException:
        shutil.rmtree(work_dir, ignore_errors=True)
        raise
    return record


def main(argv: list[str] | None = None) -> int:
    """`python -m finetune.embedded.build`: (re)build a shipped base, or check that a rebuild matches it."""
    import argparse
    import sys
    import tempfile

    parser = argparse.ArgumentParser(description="Build an embedded base from its registered settings.")
    parser.add_argument("--name", default="tiny-llama", choices=sorted(EMBEDDED_BASES))
    parser.add_argument("--out", type=Path, help="where to write it (default: the package's shipped directory)")
    parser.add_argument("--check", action="store_true", help="build into a scratch directory and compare its "
                        "sha256 with the shipped base's record; exit 1 when they differ")  # fmt: skip
    args = parser.parse_args(argv)
    say = lambda message: print(f"[build {args.name}] {message}", file=sys.stderr, flush=True)
    shipped = shipped_base_dir(args.name)
    if not args.check:
        record = _build_beside(args.out or shipped, EMBEDDED_BASES[args.name], say)
        say(f"wrote {args.out or shipped} in {record['seconds']:.0f} s; sha256 {record['sha256']}")
        return 0
    try:
        check_shipped_base(shipped)  # the shipped files are what their record says
    except ModelError as error:
        say(str(error))
        return 1
    recorded = json.loads((shipped / RECORD_FILE).read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory() as scratch:
        record = _build_beside(Path(scratch) / args.name, EMBEDDED_BASES[args.name], say)
    same = record["sha256"] == recorded["sha256"]
    say(f"rebuild {'matches' if same else 'DIFFERS FROM'} the shipped base: {record['sha256']} vs {recorded['sha256']}")
    if not same and record["versions"] != recorded["versions"]:
        say(f"(built with {record['versions']}; the shipped base with {recorded['versions']})")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
