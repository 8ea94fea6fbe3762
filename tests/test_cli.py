"""The `finetune` command, in-process and as a real subprocess: results on stdout, user errors as one line + exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ALL_LINEAR, REPO, greedy_text, make_adapter

from finetune.cli import main


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "finetune", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def assert_user_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0]


@pytest.mark.slow
def test_train_eval_generate_as_subprocesses(workdir, tiny_base_dir):
    trained = run_cli("train", "recipe.yaml", "train.max_steps=4")
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert "adapter: adapters/crates" in trained.stdout
    assert "held-out perplexity: base" in trained.stderr

    evaluated = run_cli("eval", "--adapter", "adapters/crates", "--data", "valid.jsonl", "--format", "instruction")
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    base_line, tuned_line = evaluated.stdout.strip().splitlines()
    assert base_line.startswith("base: perplexity ")
    assert tuned_line.startswith("base + adapter: perplexity ") and "% lower" in tuned_line

    prompt = "What colour is crate 3?"
    generated = run_cli("generate", "--adapter", "adapters/crates", "--max-new-tokens", "5", prompt)
    assert generated.returncode == 0, generated.stderr[-2000:]
    assert generated.stdout == greedy_text(tiny_base_dir, "adapters/crates", prompt, 5) + "\n"


def _plain_perplexity(base_dir: Path, adapter_dir: Path | None, texts: list[str]) -> tuple[float, int]:
    """Mean next-token loss and its token count over `texts`, one document per forward pass, with plain
    transformers (+ peft): BOS, the text, EOS; every token after BOS predicted. The reference for `eval`."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    total, count = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]]
            ids = torch.tensor([[*ids, tokenizer.eos_token_id]])
            logits = model.eval()(input_ids=ids).logits[0, :-1]  # (T-1, vocab): position t predicts t+1
            total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    return total / count, count


def test_eval_perplexity_equals_a_plain_transformers_and_peft_loop(tmp_path, tiny_base_dir, capsys):
    """`finetune eval` packs documents into rows of a batch; its loss, perplexity and token count are those of
    scoring each document alone with plain transformers and peft, to the printed digits."""
    import json
    import math
    import re

    from helpers import LIBRARY_ULPS, tokenizer_corpus, ulp

    texts = tokenizer_corpus()[:19:2] + ["def add(a, b):\n    return a + b\n"]
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    adapter = make_adapter(tiny_base_dir, tmp_path / "lively", seed=3, targets=ALL_LINEAR, magnitude=0.3)
    argv = ["eval", "--base", str(tiny_base_dir), "--adapter", str(adapter), "--data", str(tmp_path / "held_out.jsonl")]
    assert main([*argv, "--batch-size", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    number = r"([\d.]+)"
    for line, adapter_dir in zip(lines, (None, adapter)):
        loss, count = _plain_perplexity(tiny_base_dir, adapter_dir, texts)
        printed = re.search(rf"perplexity {number} \(loss {number}", line)
        assert printed, line
        # printed to 4 decimals (half a unit: 5e-5), from a float32 sum in another order (a few hundred ulps)
        assert abs(float(printed[2]) - loss) <= 5e-5 + LIBRARY_ULPS * ulp(loss), line
        assert abs(float(printed[1]) - math.exp(loss)) <= 5e-5 + LIBRARY_ULPS * ulp(math.exp(loss)), line
    assert f"over {count:,} tokens" in lines[0] and lines[1].startswith("base + adapter: perplexity")

    # The data errors' "set data.X" hints can be followed here: eval takes a recipe's data settings as key=value
    (tmp_path / "renamed.jsonl").write_text("".join(json.dumps({"body": text}) + "\n" for text in texts))
    renamed = ["eval", "--base", str(tiny_base_dir), "--data", str(tmp_path / "renamed.jsonl")]
    assert main(renamed) == 2
    assert "set data.text_field" in capsys.readouterr().err
    assert main([*renamed, "data.text_field=body", "--batch-size", "3"]) == 0
    assert capsys.readouterr().out.strip() == lines[0]
    assert main([*renamed, "train.lr=1"]) == 2
    assert "finetune eval takes data.KEY=VALUE settings only" in capsys.readouterr().err
    assert main([*renamed, "data.text_field=body", "data.train=other.jsonl"]) == 2  # took it over --data, unsaid
    assert "'data.train=other.jsonl': finetune eval sets that with --data" in capsys.readouterr().err
    for held_out in ("data.validation_split=0.5", "data.validation=other.jsonl"):  # a share of --data left out, unsaid
        assert main([*renamed, "data.text_field=body", held_out]) == 2
        assert f"'{held_out}': finetune eval scores every record of --data" in capsys.readouterr().err


def test_eval_json_holds_the_printed_figures(tmp_path, tiny_base_dir, capsys):
    """`eval --json`: one JSON object on stdout, the figures of the human lines; without an adapter, "adapter" is
    null."""
    import json

    (tmp_path / "held_out.jsonl").write_text(
        "".join(json.dumps({"text": f"line {i} of text\n"}) + "\n" for i in range(5))
    )
    adapter = make_adapter(tiny_base_dir, tmp_path / "lively", seed=3, targets=ALL_LINEAR, magnitude=0.3)
    argv = ["eval", "--base", str(tiny_base_dir), "--adapter", str(adapter), "--data", str(tmp_path / "held_out.jsonl")]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert main([*argv, "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert lines[0] == (
        f"base: perplexity {figures['base']['eval_ppl']:.4f} (loss {figures['base']['eval_loss']:.4f} over "
        f"{figures['base']['eval_tokens']:,} tokens)"
    )
    assert lines[1].startswith(f"base + adapter: perplexity {figures['adapter']['eval_ppl']:.4f} ")
    assert main([*argv[:3], *argv[5:], "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"base": figures["base"], "adapter": None}


@pytest.mark.parametrize("chat", [False, True])
def test_generate_prints_the_greedy_tokens_of_base_and_adapter(tmp_path, tiny_base_dir, capsys, chat):
    """An adapter on every linear layer with large weights: its tokens vary, depend on the whole prompt (BOS
    included) and differ from the base's, so the reference tells a wrong prompt or a missing adapter apart."""
    lively = make_adapter(tiny_base_dir, tmp_path / "lively", seed=11, targets=ALL_LINEAR, magnitude=0.3)
    prompt, chat_flag = "def add(a, b):\n", ["--chat"] if chat else []
    printed = {}
    for adapter in (lively, None):
        adapter_args = ["--adapter", str(adapter)] if adapter else []
        argv = ["generate", "--base", str(tiny_base_dir), *adapter_args, *chat_flag, "--max-new-tokens", "8", prompt]
        assert main(argv) == 0
        printed[adapter] = capsys.readouterr().out
        assert printed[adapter] == greedy_text(tiny_base_dir, adapter, prompt, 8, chat=chat) + "\n"
    assert len(set(printed[lively])) > 3 and printed[lively] != printed[None]  # varied text, not the base's


def test_validate_reports_ok_and_errors(workdir, capsys):
    assert main(["validate", "recipe.yaml", "lora.r=16"]) == 0
    assert "ok" in capsys.readouterr().out
    assert main(["validate", "recipe.yaml", "lora.rr=16"]) == 2
    assert "did you mean 'r'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["train", "nope.yaml"], ["nope.yaml does not exist"]),
        (["train", "recipe.yaml", "train.lr"], ["not key=value"]),
        (["train", "recipe.yaml", "trian.lr=1"], ["trian: unknown key", "did you mean 'train'"]),
        (["train", "recipe.yaml", "train.lr=fast"], ["train.lr"]),
        (["train", "recipe.yaml", "data.train=absent.jsonl"], ["absent.jsonl"]),
        (["train", "recipe.yaml", "lora.target_modules=[wq]"], ["wq", "q_proj"]),
        # peft reads a list's entries as names, never as regexes, and wraps no norm or block: two tracebacks before
        (["train", "recipe.yaml", r"lora.target_modules=[.*layers\.0\..*_proj]"], ["match no module", "not a regex"]),
        (["train", "recipe.yaml", "lora.target_modules=[q_proj,input_layernorm]"], ["LlamaRMSNorm", "cannot adapt"]),
        (["train", "recipe.yaml", "lora.target_modules=[mlp]"], ["model.layers.0.mlp, a LlamaMLP", "cannot adapt"]),
        (["train", "recipe.yaml", "model.base=."], ["not a model directory"]),
        (["eval", "--data", "valid.jsonl"], ["--base", "--adapter"]),
    ],
)
def test_user_errors_are_one_line_and_exit_2_in_process(workdir, capsys, args, fragments):
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0]
    assert not Path("adapters").exists()


@pytest.mark.slow
def test_user_errors_from_a_real_process_have_no_traceback(workdir):
    Path("broken.yaml").write_text("data:\n  train: [a.jsonl\n")
    assert_user_error(run_cli("train", "broken.yaml"), "broken.yaml:", "YAML syntax error")
    assert_user_error(run_cli("train", "recipe.yaml", "lora.target_modules=[wq]"), "match no module")


def test_overrides_may_follow_options(workdir, capsys):
    """`train R --nproc 2 k=v`: the override after the option reaches the recipe (here, rejected by it)."""
    assert main(["train", "recipe.yaml", "--nproc", "2", "train.lr=fast"]) == 2
    assert "train.lr" in capsys.readouterr().err


def test_an_unknown_option_is_still_an_argument_error(workdir):
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", "recipe.yaml", "--bogus"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    "args", [["validate", "recipe.yaml", "--bogus"], ["adapters", "info", "x", "--bogus"], ["recipes", "list", "x=1"]]
)
def test_an_unknown_argument_is_named_with_its_commands_help(args, capsys):
    """The line points at the help that lists the command's options (it said `finetune: ...; see finetune --help`)."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    command = "finetune " + " ".join(args[:2] if args[0] != "validate" else args[:1])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {command}: unrecognized arguments: ") and line.endswith(f"`{command} --help`")


@pytest.mark.parametrize("command", [["train"], ["validate"], ["plan"], ["data", "preview"]])
def test_a_missing_recipe_is_the_only_argument_named_as_required(command, capsys):
    """The recipe overrides are optional: argparse named them required beside the recipe ("the following arguments
    are required: recipe, key=value") when nothing was given, as it does for a `*` positional without a default."""
    with pytest.raises(SystemExit) as exit_info:
        main(command)
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()  # one line, as every bad input: no usage lines before it
    assert line == f"error: finetune {' '.join(command)}: the following arguments are required: recipe; see " + (
        f"`finetune {' '.join(command)} --help`"
    )


@pytest.mark.parametrize("args", [["recipes", "list"], ["--help"]])
def test_a_reader_gone_before_the_output_is_written_is_no_error(args):
    """`finetune recipes list | grep -q x`: the pipe's reader has gone when the buffered output is written. That
    write was the interpreter's, at exit: "Exception ignored ... BrokenPipeError" on stderr and exit 120 (as for
    `data preview --limit 20 | head -1`, whose last 1 KiB past the 8 KiB buffer met the closed pipe)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone before the command writes
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    env["PYTHONPATH"] = str(REPO)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "finetune", *args], stdout=write_end, stderr=subprocess.PIPE, text=True, env=env,
            timeout=120,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (0, "")


def _on_a_terminal(args: list[str], env: dict[str, str]) -> str:
    """What `finetune *args` writes to its stdout when that is a terminal (a pseudo-terminal here)."""
    import pty

    controller, terminal = pty.openpty()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "finetune", *args], stdout=terminal, stderr=subprocess.PIPE, env=env, timeout=300
        )
        os.close(terminal)
        assert result.returncode == 0, result.stderr
        chunks = []
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: the terminal's last writer has closed it
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(controller)
    return b"".join(chunks).decode()


def test_data_preview_colours_a_terminal_unless_no_color_is_set(workdir):
    """NO_COLOR (https://no-color.org) switches the green marks off on a terminal: they are `[[...]]` as in a pipe."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("NO_COLOR", None)
    args = ["data", "preview", "recipe.yaml", "--limit", "1"]
    assert "\033[32m" in _on_a_terminal(args, env)  # a terminal, or the test would prove nothing
    plain = _on_a_terminal(args, {**env, "NO_COLOR": "1"})
    assert "\033" not in plain and "[[" in plain and "(green)" not in plain


def test_version_is_the_packages(capsys):
    from finetune.version import __version__

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"finetune {__version__}\n"


@pytest.mark.parametrize("scale", [3.0, 60.0])
def test_eval_and_training_give_one_perplexity_for_a_loss_beyond_50_and_past_float_range(scale):
    """A diverged or badly scaled model's mean loss can pass 50 (training capped its perplexity at exp(50)) and
    709.78 (past float range: `finetune eval` died of an OverflowError). Both now give exp(loss), inf past range."""
    import math

    import torch
    from helpers import tiny_model

    from finetune.data.collate import collate_batch
    from finetune.scoring import perplexity
    from finetune.training.evaluate import evaluate

    model = tiny_model("llama")
    with torch.no_grad():  # sharpen the logits: the loss of a random model grows with the scale
        model.lm_head.weight.mul_(scale * 40)
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": [-100, *ids[1:]]} for ids in torch.randint(0, 96, (6, 20), generator=generator).tolist()]  # fmt: skip

    def collate(batch):
        return collate_batch(batch, pad_token_id=0, packing=True)

    scored = perplexity(model, rows, collate=collate, micro_batch_size=4)
    trained = evaluate(model, rows, collate=collate, micro_batch_size=4)
    assert 50 < scored["eval_loss"] and (scored["eval_loss"] > 710) == (scale > 10)
    expected = math.exp(scored["eval_loss"]) if scored["eval_loss"] < 709 else math.inf
    assert scored["eval_ppl"] == pytest.approx(expected, rel=1e-9)
    assert trained["eval_ppl"] == pytest.approx(scored["eval_ppl"], rel=1e-5)
    from finetune.report.runs import perplexity_change

    assert perplexity_change(math.inf, math.inf) == "no percentage: a perplexity is not a finite number"  # not "nan%"


def test_eval_says_which_records_its_figure_leaves_out(tmp_path, tiny_base_dir, capsys):
    """Records cut to --max-seq-len (tails not scored) or dropped (nothing to score) changed the printed perplexity
    without a word; each is now a warning line on stderr, and a file scored whole has none."""
    import json

    from helpers import instruction_records

    records = [*instruction_records(4), {"instruction": "Say nothing.", "input": "", "output": "  "}]
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    argv = ["eval", "--base", str(tiny_base_dir), "--data", str(tmp_path / "held_out.jsonl"), "--format", "instruction"]
    lengths = []
    for max_seq_len in ("512", "75"):  # prompts of 45-68 tokens, documents of 65-90
        assert main([*argv, "--max-seq-len", max_seq_len]) == 0
        out, err = capsys.readouterr()
        lengths.append(int(out.split(" over ")[1].split()[0].replace(",", "")))
        warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
        dropped = (
            "warning: 1 of 5 records had nothing to score (an empty response or text, no assistant turn, or a prompt "
            "filling "
        )
        assert warnings[-1].startswith(dropped + f"--max-seq-len={max_seq_len})")
        if max_seq_len == "75":
            assert warnings[0].startswith(
                "warning: 2 of 5 records are longer than --max-seq-len=75 tokens and were cut"
            )
        else:
            assert len(warnings) == 1
    assert lengths[1] < lengths[0]


def test_eval_says_when_text_records_were_split_into_pieces(tmp_path, tiny_base_dir, capsys):
    """Text's default data.overlength=split scores a long record as pieces, each without the text before it and
    without its first token: the figure moved (the tiny base on 20 bulletins: 8991 whole, 1671 at --max-seq-len 40)
    and eval said nothing, where records cut or dropped each had their warning line."""
    import json

    texts = [" ".join(f"word{i} number {i * 7}" for i in range(40)), "A short line."]
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    argv = ["eval", "--base", str(tiny_base_dir), "--data", str(tmp_path / "texts.jsonl")]
    figures = {}
    for max_seq_len in ("1024", "32"):
        assert main([*argv, "--max-seq-len", max_seq_len]) == 0
        out, err = capsys.readouterr()
        figures[max_seq_len] = out
        warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
        if max_seq_len == "1024":
            assert warnings == []
        else:
            assert warnings == [
                "warning: 1 of 2 records are longer than --max-seq-len=32 tokens and were split into pieces scored "
                "apart: each later piece's first token is not in the figure and its tokens are predicted without the "
                "text before it; raise --max-seq-len to score them whole"
            ]
    assert figures["1024"] != figures["32"]  # the warning is about a figure that did change


def test_eval_refuses_an_adapter_that_is_no_adapter_directory(tmp_path, tiny_base_dir, capsys):
    """`--adapter` alone went to `load_model` as "a base or an adapter": a base's directory given there was scored as
    the base with no adapter line (exit 0, "adapter": null under --json), and a mistyped path failed as a base model
    that could not be downloaded. Both are now one line naming --adapter, exit 2; a real adapter still scores."""
    import json

    from helpers import instruction_records

    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in instruction_records(2)))
    argv = ["eval", "--data", str(data), "--format", "instruction", "--json"]
    for given in (str(tiny_base_dir), str(tmp_path / "no-such-adapter")):
        assert main([*argv, "--adapter", given]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"error: --adapter {given}: not an adapter directory")
    make_adapter(tiny_base_dir, tmp_path / "adapter", seed=0)
    assert main([*argv, "--adapter", str(tmp_path / "adapter")]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["adapter"]["eval_tokens"] == figures["base"]["eval_tokens"] > 0


def test_eval_names_a_chat_record_without_an_assistant_turn_among_the_dropped(tmp_path, tiny_base_dir, capsys):
    """A chat record with no assistant turn has nothing to score; the warning listed only an empty response or text
    and a prompt filling --max-seq-len, neither of which it was (the all-dropped error and the training log name it)."""
    import json

    chats = [
        {
            "messages": [
                {"role": "user", "content": "Hello there."},
                {"role": "assistant", "content": "Hi, how are you?"},
            ]
        },
        {"messages": [{"role": "user", "content": "Anyone?"}]},
    ]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    argv = ["eval", "--base", str(tiny_base_dir), "--data", str(tmp_path / "chats.jsonl"), "--format", "chat"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "warning: 1 of 2 records had nothing to score (an empty response or text, no assistant turn, " in err
