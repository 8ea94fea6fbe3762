"""The table of bad inputs: every one is exit 2, one `error:` line saying what, where and how, no traceback,
and nothing half-written.

Each case prepares its bad input inside a working directory that holds a good recipe (`recipe.yaml` on the
tiny base), good data and a good adapter, then runs the CLI in-process. A handful run again as real
subprocesses (the console a user sees, and what only a process can do: a file-size limit, a signal).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import TEST_SHAPE, make_adapter

from finetune.cli import main
from finetune.embedded.tiny import build_tiny_llama
from finetune.embedded.tokenizer import train_tokenizer

REPO = Path(__file__).resolve().parents[1]
Setup = Callable[[Path], None]


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]
    fragments: tuple[str, ...]
    setup: Setup | None = None


def write(relative: str, content: str | bytes) -> Setup:
    def setup(work: Path) -> None:
        path = work / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)

    return setup


def truncate(relative: str, keep_fraction: float = 0.5) -> Setup:
    def setup(work: Path) -> None:
        path = work / relative
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * keep_fraction)])

    return setup


def edit_json(relative: str, change: Callable[[dict], None]) -> Setup:
    def setup(work: Path) -> None:
        path = work / relative
        document = json.loads(path.read_text())
        change(document)
        path.write_text(json.dumps(document))

    return setup


def both(*setups: Setup) -> Setup:
    def setup(work: Path) -> None:
        for each in setups:
            each(work)

    return setup


def copy_dir(source: str, relative: str) -> Setup:
    return lambda work: shutil.copytree(work / source, work / relative)


def make_dir(relative: str) -> Setup:
    return lambda work: (work / relative).mkdir(parents=True)


def train_a_checkpoint(work: Path) -> None:
    assert main(["train", "recipe.yaml", "train.max_steps=2", "train.save_every_steps=1", "output.name=first"]) == 0


CHAT_RECORD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
PAIRS = ("data.format=preference", "train.objective=dpo", "data.validation=[]")
ADAPTER = "adapter"  # a good adapter for the tiny base, copied into every working directory
MERGE = ("adapters", "merge", "--base", "base", "--adapter")

CASES = [
    # Recipes
    Case("recipe-missing", ("validate", "nope.yaml"), ("nope.yaml does not exist",)),
    Case("recipe-is-a-directory", ("validate", "somedir"), ("is a directory",), make_dir("somedir")),
    Case("recipe-empty", ("validate", "empty.yaml"), ("is empty",), write("empty.yaml", "")),
    Case("recipe-is-a-list", ("validate", "list.yaml"), ("must be a mapping",), write("list.yaml", "- a\n- b\n")),
    Case("recipe-binary", ("validate", "bin.yaml"), ("bin.yaml",), write("bin.yaml", bytes(range(256)) * 4)),
    Case(
        "recipe-yaml-syntax",
        ("validate", "bad.yaml"),
        ("bad.yaml:2", "YAML syntax"),
        write("bad.yaml", "a: 1\n b: [\n"),
    ),
    Case("recipe-duplicate-key", ("validate", "dup.yaml"), ("given twice",), write("dup.yaml", "data: {}\ndata: {}\n")),
    Case(
        "recipe-unknown-key",
        ("validate", "recipe.yaml", "lora.rank=8"),
        (
            "lora.rank",
            "did you mean 'r'",
        ),
    ),
    Case("number-as-words", ("validate", "recipe.yaml", "train.max_steps=ten"), ("train.max_steps",)),
    # "" was read as the current directory: "a directory but not one written by datasets.save_to_disk"
    Case(
        "validate-an-empty-data-path",
        ("validate", "recipe.yaml", "data.train="),
        ("data.train[0].path", "at least 1 character"),
    ),
    Case(
        "validate-a-missing-data-file",
        ("validate", "recipe.yaml", "data.train=nosuch.jsonl"),
        ("data file nosuch.jsonl does not exist",),
    ),  # fmt: skip
    # a directory that save_to_disk did not write failed only
    # when training loaded the data, after the base
    # a missing starting adapter was found by the run only, after the base and the data had loaded
    Case(
        "validate-init-from-missing",
        ("validate", "recipe.yaml", "lora.init_from=adapters/none"),
        ("lora.init_from: adapters/none is not an adapter directory",),
    ),  # fmt: skip
    Case(
        "validate-a-plain-directory",
        ("validate", "recipe.yaml", "data.train=somedir"),
        ("not one written by",),
        make_dir("somedir"),
    ),  # fmt: skip
    Case("negative-steps", ("validate", "recipe.yaml", "train.max_steps=-5"), ("train.max_steps", "greater than")),
    Case("lr-zero", ("validate", "recipe.yaml", "train.lr=0"), ("train.lr",)),
    # the HF Trainer's "none": was "greater than or equal to 1", which did not say that null switches it off
    Case(
        "eval-every-zero-steps",
        ("validate", "recipe.yaml", "train.eval_every_steps=0"),
        ("train.eval_every_steps: 0 is no interval or count", "null for none"),
    ),  # fmt: skip
    Case(
        "missing-data-train",
        ("validate", "nodata.yaml"),
        ("data: required",),
        write("nodata.yaml", "output: {name: x}\n"),
    ),
    Case("output-name-escapes", ("validate", "recipe.yaml", "output.name=../evil"), ("output.name", "not a valid")),
    Case("output-name-absolute", ("validate", "recipe.yaml", "output.name=/tmp/evil"), ("output.name",)),
    Case("override-not-key-value", ("validate", "recipe.yaml", "train.lr"), ("is not key=value",)),
    Case("override-into-a-value", ("validate", "recipe.yaml", "train.lr.x=1"), ("is a value, not a section",)),
    Case("override-empty-part", ("validate", "recipe.yaml", "train..lr=1"), ("empty key part",)),
    Case("bad-format", ("validate", "recipe.yaml", "data.format=poem"), ("data.format",)),
    # Data
    Case("data-missing", ("train", "recipe.yaml", "data.train=missing.jsonl"), ("missing.jsonl",)),
    Case("data-is-a-directory", ("train", "recipe.yaml", "data.train=folder"), ("folder",), make_dir("folder/sub")),
    Case(
        "jsonl-line-not-json",
        ("train", "recipe.yaml", "data.train=broken.jsonl"),
        ("broken.jsonl", "line 2"),
        write("broken.jsonl", '{"instruction": "a", "output": "b"}\n{not json\n'),
    ),  # fmt: skip
    Case(
        "record-missing-field",
        ("train", "recipe.yaml", "data.train=nofield.jsonl"),
        ("nofield.jsonl", "output"),
        write("nofield.jsonl", '{"instruction": "a"}\n'),
    ),  # fmt: skip
    Case("data-empty", ("train", "recipe.yaml", "data.train=empty.jsonl"), ("empty.jsonl",), write("empty.jsonl", "")),
    Case(
        "data-unknown-extension",
        ("train", "recipe.yaml", "data.train=data.xml"),
        ("data.xml",),
        write("data.xml", "<a/>"),
    ),  # fmt: skip
    Case(
        "chat-without-assistant-turn",
        ("train", "recipe.yaml", "data.format=chat", "data.train=chat.jsonl", "data.validation=[]"),
        ("chat.jsonl",),
        write("chat.jsonl", json.dumps({"messages": [{"role": "user", "content": "only a question"}]}) + "\n"),
    ),  # fmt: skip
    # Preference data and objectives
    Case(
        "objective-setting-of-another-objective",
        ("validate", "recipe.yaml", *PAIRS, "train.simpo_gamma=1.0"),
        ("simpo_gamma applies to objective simpo, not dpo",),
    ),
    Case(
        "objective-without-its-format", ("validate", "recipe.yaml", "train.objective=dpo"), ("data.format=preference",)
    ),
    Case(
        "pair-missing-chosen",
        ("train", "recipe.yaml", *PAIRS, "data.train=pairs.jsonl"),
        ("pairs.jsonl line 1", "no field 'chosen'"),
        write("pairs.jsonl", json.dumps({"prompt": "Q", "rejected": "A"}) + "\n"),
    ),  # fmt: skip
    Case(
        "pair-chosen-equals-rejected",
        ("train", "recipe.yaml", *PAIRS, "data.train=pairs.jsonl"),
        ("pairs.jsonl line 2", "chosen and rejected are the same"),
        write("pairs.jsonl", "".join(json.dumps({"prompt": "Q", "chosen": c, "rejected": "B"}) + "\n" for c in "AB")),
    ),  # fmt: skip
    Case(
        "pair-chosen-message-equals-rejected-string",
        ("data", "preview", "recipe.yaml", *PAIRS, "data.train=pairs.jsonl"),
        ("pairs.jsonl line 1 (record 1): chosen and rejected are the same",),
        write(
            "pairs.jsonl",
            json.dumps(
                {
                    "prompt": [{"role": "user", "content": "Q"}],
                    "chosen": [{"role": "assistant", "content": "A"}],
                    "rejected": "A",
                }
            )
            + "\n",
        ),
    ),  # fmt: skip
    Case(
        "unpaired-label-not-boolean",
        (
            "train",
            "recipe.yaml",
            "data.format=unpaired_preference",
            "train.objective=kto",
            "data.train=kto.jsonl",
            "data.validation=[]",
        ),
        ("kto.jsonl line 1", "'label' must be true", "str 'yes'"),
        write("kto.jsonl", json.dumps({"prompt": "Q", "completion": "A", "label": "yes"}) + "\n"),
    ),  # fmt: skip
    Case(
        "preference-null-prompt",
        ("data", "preview", "recipe.yaml", *PAIRS, "data.train=null.jsonl"),
        ("null.jsonl line 1 (record 1): field 'prompt' is null",),
        write("null.jsonl", json.dumps({"prompt": None, "chosen": "y", "rejected": "n"}) + "\n"),
    ),  # fmt: skip
    Case(
        "preference-empty-rejected-turns",
        ("data", "preview", "recipe.yaml", *PAIRS, "data.train=empty.jsonl"),
        ("rejected: field 'completion' must be a non-empty list", "got an empty list; fix the record"),
        write(
            "empty.jsonl",
            json.dumps(
                {
                    "prompt": [{"role": "user", "content": "Q"}],
                    "chosen": [{"role": "assistant", "content": "A"}],
                    "rejected": [],
                }
            )
            + "\n",
        ),
    ),  # fmt: skip
    Case(
        "preview-refuses-a-prompt-that-leaves-no-room-as-training-does",
        ("data", "preview", "recipe.yaml", *PAIRS, "data.train=long.jsonl", "data.max_seq_len=8"),
        ("long.jsonl line 1 (record 1): the prompt leaves no room", "data.overlength=truncate_prompt"),
        write(
            "long.jsonl",
            json.dumps({"prompt": "the model reads a document and predicts", "chosen": "y", "rejected": "n"}) + "\n",
        ),
    ),  # fmt: skip
    Case(
        "prompt-leaves-no-room-for-the-completion",
        ("train", "recipe.yaml", *PAIRS, "data.train=long.jsonl", "data.max_seq_len=8"),
        ("2 of 3 records", "data.max_seq_len=8", "data.overlength=truncate_prompt"),
        write(
            "long.jsonl",
            "".join(
                json.dumps({"prompt": p, "chosen": "yes", "rejected": "no"}) + "\n"
                for p in ("the model reads a document and predicts", "a", "the adapter learns a low rank update")
            ),
        ),
    ),  # fmt: skip
    # Model directories
    Case("base-missing", ("train", "recipe.yaml", "model.base=./no-such-model"), ("no such directory",)),
    Case(
        "base-without-config", ("train", "recipe.yaml", "model.base=./folder"), ("no config.json",), make_dir("folder")
    ),  # fmt: skip
    Case(
        "base-shard-truncated",
        ("train", "recipe.yaml", "model.base=./base"),
        ("model.safetensors", "truncated"),
        truncate("base/model.safetensors"),
    ),  # fmt: skip
    Case(
        "base-hub-id-not-cached",
        ("train", "recipe.yaml", "model.base=nobody/nothing-here"),
        ("nobody/nothing-here", "hf download"),
    ),
    Case("targets-match-nothing", ("train", "recipe.yaml", "lora.target_modules=[qkv_proj]"), ("qkv_proj", "match no")),
    Case(
        "tokenizer-larger-than-embedding",
        ("train", "recipe.yaml", "model.tokenizer=./big-tokenizer"),
        ("big-tokenizer", "embedding has only"),
    ),  # fmt: skip
    # Adapters and merged checkpoints
    Case("adapter-missing", (*MERGE, "no-adapter", "--out", "merged"), ("no-adapter",)),
    Case(
        "adapter-without-config", (*MERGE, "folder", "--out", "merged"), ("no adapter_config.json",), make_dir("folder")
    ),  # fmt: skip
    Case(
        "adapter-truncated",
        (*MERGE, ADAPTER, "--out", "merged"),
        ("adapter_model.safetensors",),
        truncate(f"{ADAPTER}/adapter_model.safetensors"),
    ),  # fmt: skip
    Case(
        "adapter-config-not-json",
        (*MERGE, ADAPTER, "--out", "merged"),
        ("adapter_config.json", "not valid JSON"),
        write(f"{ADAPTER}/adapter_config.json", "{oops"),
    ),  # fmt: skip
    Case(
        "adapter-for-another-base",
        (*MERGE, ADAPTER, "--out", "merged"),
        ("was trained on base", "--force"),
        lambda work: _replace_base(work),
    ),  # fmt: skip
    Case(
        "adapter-pickle",
        (*MERGE, "pickled", "--out", "merged"),
        ("pickle", "--allow-pickle"),
        lambda work: _pickle_adapter(work),
    ),  # fmt: skip
    Case("adapter-weight-not-a-number", (*MERGE, f"{ADAPTER}:heavy", "--out", "merged"), ("heavy",)),
    Case("merge-out-exists", (*MERGE, ADAPTER, "--out", "folder"), ("folder already exists",), make_dir("folder")),
    # a merged model's own shards were never checked (its base's fingerprint is read from its ledger): safetensors'
    # "incomplete metadata" traceback, exit 1, when the stream opened them
    *(
        Case(
            f"{command}-from-a-truncated-merged-model",
            argv,
            ("merged0/model.safetensors", "truncated"),
            both(lambda work: _merge_into(work, "merged0"), truncate("merged0/model.safetensors", 0.9)),
        )
        for command, argv in (
            (
                "swap",
                ("adapters", "swap", "--model", "merged0", "--remove", ADAPTER, "--add", ADAPTER, "--out", "merged"),
            ),
            ("merge", ("adapters", "merge", "--base", "merged0", "--adapter", f"{ADAPTER}:0.5", "--out", "merged")),
        )
    ),  # fmt: skip
    Case(
        "subtract-over-a-truncated-pristine-base",
        (
            "adapters",
            "subtract",
            "--model",
            "merged0",
            "--adapter",
            ADAPTER,
            "--base",
            "base2",
            "--force",
            "--out",
            "merged",
        ),
        ("base2/model.safetensors", "truncated"),
        both(lambda work: _merge_into(work, "merged0"), copy_dir("base", "base2"), truncate("base2/model.safetensors")),
    ),  # fmt: skip
    Case(
        "info-truncated",
        ("adapters", "info", ADAPTER),
        ("truncated",),
        truncate(f"{ADAPTER}/adapter_model.safetensors", 0.9),
    ),  # fmt: skip
    Case(
        "info-no-target-modules",
        ("adapters", "info", ADAPTER),
        ("no target_modules",),
        edit_json(f"{ADAPTER}/adapter_config.json", lambda c: c.pop("target_modules")),
    ),  # fmt: skip
    Case("info-neither", ("adapters", "info", "folder"), ("neither an adapter",), make_dir("folder")),
    Case(
        "combine-nan-weight",
        ("adapters", "combine", ADAPTER, ADAPTER, "--weights", "1,nan", "--out", "c"),
        ("--weights", "finite"),
    ),  # fmt: skip
    # options a method does not read were silently unused (`cat --rank 2` kept every input's rank)
    *(
        Case(
            f"combine-{method}-{option[2:]}",
            ("adapters", "combine", ADAPTER, ADAPTER, "--method", method, option, value, "--out", "c"),
            (f"{option} applies to --method", f"not {method}"),
        )
        for method, option, value in (("cat", "--rank", "2"), ("svd", "--density", "0.3"), ("ties", "--seed", "1"))
    ),  # fmt: skip
    Case(
        "subtract-from-a-plain-base",
        ("adapters", "subtract", "--model", "base", "--adapter", "x", "--out", "m"),
        ("x",),
    ),  # fmt: skip
    # Training runs and checkpoints
    Case(
        "output-exists", ("train", "recipe.yaml"), ("already exists", "output.overwrite"), make_dir("adapters/crates")
    ),
    Case(
        "overwrite-a-project-directory",
        ("train", "recipe.yaml", "output.dir=project", "output.overwrite=true"),
        ("project", "no adapter_config.json", "output.dir"),
        lambda work: (work / "project" / "src").mkdir(parents=True) or (work / "project/src/main.py").write_text("1"),
    ),  # fmt: skip
    Case(
        "overwrite-a-file",
        ("train", "recipe.yaml", "output.dir=notes.md", "output.overwrite=true"),
        ("notes.md", "not a directory"),
        lambda work: (work / "notes.md").write_text("notes"),
    ),  # fmt: skip
    Case("resume-without-checkpoint", ("train", "recipe.yaml", "--resume"), ("no checkpoint",)),
    Case(
        "resume-truncated-checkpoint",
        ("train", "recipe.yaml", "output.name=first", "--resume"),
        ("trainable.safetensors", "truncated"),
        both(train_a_checkpoint, truncate("runs/first/checkpoint-000002/trainable.safetensors")),
    ),  # fmt: skip
    Case(
        "resume-another-recipe",
        ("train", "recipe.yaml", "output.name=first", "lora.r=8", "--resume"),
        ("different recipe",),
        train_a_checkpoint,
    ),  # fmt: skip
    Case(
        "nonfinite-loss",
        ("train", "recipe.yaml", "train.lr=1e30", "train.max_grad_norm=null"),
        ("not finite", "no adapter was written"),
    ),  # fmt: skip
    Case(
        "read-only-output",
        ("train", "recipe.yaml", "output.dir=locked/crates"),
        ("locked/crates", "write"),
        lambda work: _immutable(work / "locked"),
    ),  # fmt: skip
    # Output paths and run records of the other commands
    Case(
        "export-under-a-file",
        ("export", "gguf", "--model", "base", "--out", "notes.md/model.gguf"),
        ("cannot write notes.md/model.gguf: notes.md is a file, not a directory",),
        write("notes.md", "notes"),
    ),  # fmt: skip
    Case(
        "report-a-corrupt-run-record",
        ("report", "runs/r"),
        ("runs/r/run.json is not a run record", "delete it"),
        both(
            write("runs/r/metrics.jsonl", '{"step": 1, "loss": 2.0, "tokens_seen": 8}\n'), write("runs/r/run.json", "{")
        ),
    ),  # fmt: skip
    Case("recipes-show-no-file", ("recipes", "show", "nothere.yaml"), ("no recipe file nothere.yaml",)),
    Case(
        "recipes-show-not-utf8",
        ("recipes", "show", "latin1.yaml"),
        ("latin1.yaml cannot be read", "UTF-8"),
        write("latin1.yaml", "output: {name: caf\xe9}\n".encode("latin-1")),
    ),  # fmt: skip
    # CLI arguments
    Case("generate-without-model", ("generate", "hello"), ("--base", "--adapter")),
    # no manifest to check it by: the light path multiplied the wrong shapes (a RuntimeError)
    Case(
        "generate-adapter-of-another-size",
        ("generate", "--base", "base", "--adapter", "other-adapter", "hello"),
        ("model.layers.0.mlp.down_proj is (64, 128) in", "another base size"),
        lambda work: _adapter_of_another_size(work),
    ),  # fmt: skip
    # a tokenizer without a BOS (Qwen's) gives an empty prompt no tokens: both paths failed on an empty tensor
    *(
        Case(
            f"generate-nothing-to-continue-{path}",
            ("generate", "--base", "no-bos", *flags, ""),
            ("the prompt is empty", "has no BOS"),
            both(
                copy_dir("base", "no-bos"),
                edit_json("no-bos/tokenizer.json", lambda tokenizer: tokenizer.update(post_processor=None)),
                edit_json("no-bos/tokenizer_config.json", lambda settings: settings.update(bos_token=None)),
            ),
        )
        for path, flags in (("light", ()), ("transformers", ("--temperature", "0.5")))
    ),  # fmt: skip
    Case("nproc-zero", ("train", "recipe.yaml", "--nproc", "0"), ("--nproc",)),
    # a node rank past --nnodes waited forever for the rendezvous
    Case(
        "node-rank-past-nnodes",
        ("train", "recipe.yaml", "--nproc", "2", "--nnodes", "2", "--node-rank", "5"),
        ("--node-rank 5: give 0 .. 1",),
    ),  # fmt: skip
    Case(
        "node-rank-without-main-address",
        ("train", "recipe.yaml", "--nnodes", "2", "--node-rank", "1"),
        ("give --main-address",),
    ),  # fmt: skip
]


def _replace_base(work: Path) -> None:
    """The working directory's `base` becomes another model (other weights), so the adapter does not fit."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(work / "base")
    shutil.rmtree(work / "base")
    from helpers import TEST_SHAPE

    build_tiny_llama(tokenizer, seed=7, **TEST_SHAPE).save_pretrained(work / "base")
    tokenizer.save_pretrained(work / "base")


def _adapter_of_another_size(work: Path) -> None:
    """./other-adapter: a manifest-less adapter of a base whose MLP is wider than ./base's."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(work / "base")
    build_tiny_llama(tokenizer, seed=7, **{**TEST_SHAPE, "intermediate_size": 96}).save_pretrained(work / "other")
    tokenizer.save_pretrained(work / "other")
    make_adapter(work / "other", work / "other-adapter", seed=3, targets=("down_proj",), manifest=False)


def _merge_into(work: Path, out: str) -> None:
    assert main([*MERGE, ADAPTER, "--out", out]) == 0


def _pickle_adapter(work: Path) -> None:
    import torch
    from safetensors.torch import load_file

    shutil.copytree(work / ADAPTER, work / "pickled")
    torch.save(load_file(work / "pickled" / "adapter_model.safetensors"), work / "pickled" / "adapter_model.bin")
    (work / "pickled" / "adapter_model.safetensors").unlink()


_immutable_dirs: list[Path] = []


def _immutable(path: Path) -> None:
    """A directory nobody may write into, root included (`chattr +i`), undone after the test."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
    elif subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("this filesystem cannot make a directory immutable (chattr +i), and root ignores chmod")
    _immutable_dirs.append(path)


@pytest.fixture()
def bad_input_workdir(workdir, tiny_base_dir, tiny_tokenizer):
    """`workdir` plus a copy of the tiny base at ./base, a good adapter for it, and a larger tokenizer."""
    shutil.copytree(tiny_base_dir, workdir / "base")
    make_adapter(tiny_base_dir, workdir / ADAPTER, seed=3)
    from helpers import tokenizer_corpus

    big = train_tokenizer(tokenizer_corpus() + [f"word{i} token{i}" for i in range(400)], vocab_size=1024)
    big.save_pretrained(workdir / "big-tokenizer")
    yield workdir
    for path in _immutable_dirs:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)
        path.chmod(0o755)
    _immutable_dirs.clear()


def _listing(work: Path) -> set[str]:
    return {str(p.relative_to(work)) for p in work.rglob("*") if "tensorboard" not in p.parts}


def assert_one_line_error(exit_code: int, stderr: str, fragments: tuple[str, ...]) -> str:
    assert exit_code == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def assert_nothing_half_written(work: Path, before: set[str]) -> None:
    after = _listing(work)
    assert not before - after, f"bad input deleted: {sorted(before - after)}"
    new = after - before
    half = [p for p in new if ".partial-" in p or ".tmp" in p or p.startswith(("adapters/", "merged", "m/"))]
    assert not half, f"left behind: {sorted(half)}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_exit_2(case, bad_input_workdir, capsys):
    work = bad_input_workdir
    if case.setup is not None:
        case.setup(work)
    capsys.readouterr()
    before = _listing(work)
    exit_code = main(list(case.argv))
    assert_one_line_error(exit_code, capsys.readouterr().err, case.fragments)
    assert_nothing_half_written(work, before)


@pytest.mark.parametrize(
    ("override", "fragment"),
    [("output.dir=notes.md/adapters", "cannot write notes.md/adapters: notes.md is a file, not a directory"),
     ("output.run_dir=notes.md/runs", "cannot write notes.md/runs/metrics.jsonl: notes.md is a file"),
     ("output.dir=locked/adapters", "cannot write locked/adapters")],
    ids=["adapter-under-a-file", "run-dir-under-a-file", "read-only-adapter-dir"],
)  # fmt: skip
def test_an_unwritable_output_place_is_refused_before_training(override, fragment, bad_input_workdir, capsys):
    """A place the adapter or the run's files cannot be written to was found when the run wrote them: after the
    whole training (a read-only filesystem, a misspelled path through a file), which was then lost."""
    work = bad_input_workdir
    (work / "notes.md").write_text("notes")
    if "locked" in override:
        _immutable(work / "locked")
    capsys.readouterr()
    exit_code = main(["train", "recipe.yaml", override])
    output = capsys.readouterr()
    assert_one_line_error(exit_code, output.err, (fragment,))
    assert not list(work.rglob("metrics.jsonl")) and "step 1" not in output.out + output.err  # nothing trained


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [(["adapters", "merge", "--base", "b", "--adapter", "a", "--dtype", "int8", "--out", "m"], "--dtype"),
     (["adapters", "combine", "a", "b", "--method", "svd", "--rank", "-2", "--out", "c"], "--rank: -2 must be"),
     (["eval", "--adapter", "a", "--data", "d", "--batch-size", "0"], "--batch-size: 0 must be at least 1"),
     (["eval", "--adapter", "a", "--data", "d", "--max-seq-len", "0"], "--max-seq-len: 0 must be at least 1"),
     (["generate", "hi", "--max-new-tokens", "-5"], "--max-new-tokens: -5 must be at least 1"),
     (["generate", "hi", "--temperature", "nan"], "--temperature: nan must be a finite number"),
     (["serve", "--port", "99999"], "--port: 99999 is not a port"),
     (["serve", "--max-batch-size", "0"], "--max-batch-size: 0 must be at least 1")],
    ids=["merge-dtype", "combine-rank", "eval-batch", "eval-seq-len", "generate-tokens", "generate-temperature",
         "serve-port", "serve-batch"],
)  # fmt: skip
def test_a_bad_number_or_choice_is_refused_before_anything_loads(argv, fragment, capsys):
    """argparse's one-line error, exit 2: not a traceback later, nor a model of int8 zeros or a rank-126 adapter."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: finetune ") and fragment in line


def run_cli(args: list[str], cwd: Path, **popen) -> subprocess.CompletedProcess:
    env = popen.pop("env", None) or {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "finetune", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        **popen,
    )


SUBPROCESS_CASES = ["recipe-is-a-list", "jsonl-line-not-json", "adapter-for-another-base", "info-truncated"]


@pytest.mark.parametrize("case", [c for c in CASES if c.id in SUBPROCESS_CASES], ids=SUBPROCESS_CASES)
def test_bad_input_in_a_real_process_prints_only_our_line(case, bad_input_workdir):
    """What a user sees: our one line on stderr, no library chatter (bitsandbytes, progress bars), exit 2."""
    if case.setup is not None:
        case.setup(bad_input_workdir)
    result = run_cli(list(case.argv), bad_input_workdir)
    line = assert_one_line_error(result.returncode, result.stderr, case.fragments)
    assert result.stderr.strip() == line, result.stderr


def _limit_file_size() -> None:
    """In the child: files may not grow past 64 KiB (a full disk, for writers), and the limit is an error."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))


def test_a_full_disk_during_a_merge_is_one_line_and_leaves_nothing(bad_input_workdir):
    work = bad_input_workdir
    before = _listing(work)
    result = run_cli([*MERGE, ADAPTER, "--out", "merged"], work, preexec_fn=_limit_file_size)
    assert_one_line_error(result.returncode, result.stderr, ("merged", "nothing was left behind"))
    assert_nothing_half_written(work, before)


def _limit_file_size_to_8_kib() -> None:
    """In the child: files may not grow past 8 KiB: the tokenized rows of `recipe.yaml` (about 30 KiB) do not fit."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 10, 8 << 10))


def test_a_full_disk_while_tokenized_rows_are_cached_is_one_line_and_leaves_nothing(bad_input_workdir, tmp_path):
    """The tokenized-data cache (`$HF_DATASETS_CACHE/finetune`) is the first thing `finetune train` writes: a full
    disk there came out as pyarrow's OSError traceback, exit 1."""
    cache = tmp_path / "datasets-cache"
    result = run_cli(["train", "recipe.yaml"], bad_input_workdir, preexec_fn=_limit_file_size_to_8_kib,
                     env={**os.environ, "PYTHONPATH": str(REPO), "HF_DATASETS_CACHE": str(cache)})  # fmt: skip
    line = assert_one_line_error(
        result.returncode, result.stderr, (f"cannot write {cache / 'finetune'}: File too large",)
    )
    assert line.endswith("(or set HF_DATASETS_CACHE to move the tokenized-data cache)"), line
    assert [p.name for p in (cache / "finetune").iterdir()] == []


LIMIT_MEMORY = """
import resource, sys
import torch, transformers, peft, finetune.cli  # imported first: the limit is on what the run itself takes
data = next(int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith("VmData:"))
resource.setrlimit(resource.RLIMIT_DATA, (data + (512 << 20), data + (512 << 20)))
"""
"""A process's prologue: at most 512 MiB of data (heap and anonymous mappings) beyond what its imports took. A step
of 8 quickstart documents fits, one of 1,200 does not, and torch's CPU allocator then fails for real."""


def test_running_out_of_memory_is_one_line_naming_the_settings_and_writes_no_adapter(tmp_path):
    """`finetune train` that runs out of memory (here the host's, under a limit; a GPU's raises torch's
    OutOfMemoryError, handled alike) ends with one line saying so and naming what lowers the peak, exit 2."""
    args = ["train", str(REPO / "recipes" / "quickstart.yaml"), "train.micro_batch_size=1200", "train.max_steps=2",
            f"output.dir={tmp_path / 'adapter'}", f"output.run_dir={tmp_path / 'run'}", "output.report=false"]  # fmt: skip
    cli = LIMIT_MEMORY + f"sys.exit(finetune.cli.main({args!r}))"  # what `python -m finetune` runs, after the limit
    result = subprocess.run([sys.executable, "-c", cli], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    line = assert_one_line_error(result.returncode, result.stderr, ("out of host memory while allocating",))
    assert "train.micro_batch_size=1200 x data.max_seq_len=256" in line and "finetune plan" in line, line
    assert not (tmp_path / "adapter").exists()


def test_a_gpu_out_of_memory_error_reads_as_the_gpu_s_with_the_size_torch_asked_for():
    """torch's CUDA message, as its caching allocator words it: the line says GPU, the size in MiB, the settings."""
    from finetune.recipe import load_recipe
    from finetune.training.out_of_memory import is_out_of_memory, out_of_memory_line

    error = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.04 GiB "
        "is free. Of the allocated memory 76.12 GiB is allocated by PyTorch"
    )
    recipe = load_recipe("quickstart", ["train.gradient_checkpointing=auto"])
    assert is_out_of_memory(error) and is_out_of_memory(MemoryError()) and not is_out_of_memory(RuntimeError("shape"))
    line = out_of_memory_line(recipe, error)
    assert line.startswith("out of GPU memory while allocating 2,048 MiB with train.micro_batch_size=8 x "), line
    assert "train.gradient_checkpointing=auto;" in line and "\n" not in line


API_AFTER_OUT_OF_MEMORY = """
import gc
from finetune import train
from finetune.errors import TrainingError
out = sys.argv[1]
common = ["train.max_steps=1", "output.report=false", "output.overwrite=true"]
try:
    train("recipes/quickstart.yaml", ["train.micro_batch_size=1200", f"output.dir={out}/big", f"output.run_dir={out}/r1",
                                      *common], log=lambda line: None)
except TrainingError as error:
    assert error.__context__ is None and error.__cause__ is None, repr(error.__context__)
    print("caught:", error)
gc.collect()
adapter, _ = train("recipes/quickstart.yaml", ["train.micro_batch_size=8", f"output.dir={out}/small",
                                               f"output.run_dir={out}/r2", *common], log=lambda line: None)
print("trained:", adapter)
"""


def test_after_running_out_of_memory_the_api_caller_has_its_memory_back(tmp_path):
    """`finetune.train` raises the one line with nothing attached (no `__context__` holding the failed step's
    frames): in the same process, under the same limit (512 MiB of data beyond what the imports took), a run with
    a smaller micro-batch then trains."""
    done = subprocess.run([sys.executable, "-c", LIMIT_MEMORY + API_AFTER_OUT_OF_MEMORY, str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "caught: out of host memory" in done.stdout and f"trained: {tmp_path}/small" in done.stdout, done.stdout
    assert not (tmp_path / "big").exists()
