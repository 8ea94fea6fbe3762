"""`finetune adapters ...` in-process and as a real subprocess: the round trip on disk, list/info, one-line
errors with exit code 2, a killed merge leaving nothing at --out, and the adapter-level safety checks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_tensors_equal, make_adapter, read_tensors
from safetensors.torch import load_file, save_file

from finetune.adapters.lora import read_adapter, validate_adapter_name
from finetune.adapters.model_dir import SLOW_HOOK_ENV
from finetune.cli import main
from finetune.errors import AdapterError

REPO = Path(__file__).resolve().parents[1]


def run(*argv: str) -> int:
    return main(["adapters", *map(str, argv)])


def test_round_trip_merge_two_subtract_one_swap_the_other(tmp_path, tiny_base_dir, adapter_dirs, capsys):
    legal, med, code = adapter_dirs["legal"], adapter_dirs["med"], adapter_dirs["code"]
    assert (
        run(
            "merge",
            "--base",
            tiny_base_dir,
            "--adapter",
            legal,
            "--adapter",
            f"{med}:0.5",
            "--dtype",
            "bfloat16",
            "--out",
            tmp_path / "two",
        )
        == 0
    )
    assert "merged now: legal:1, med:0.5; exact" in capsys.readouterr().out
    assert run("subtract", "--model", tmp_path / "two", "--adapter", "legal", "--out", tmp_path / "one") == 0
    assert (
        run("swap", "--model", tmp_path / "one", "--remove", "med", "--add", f"{code}:2", "--out", tmp_path / "swapped")
        == 0
    )
    assert "merged now: code:2" in capsys.readouterr().out
    assert (
        run(
            "merge",
            "--base",
            tiny_base_dir,
            "--adapter",
            f"{code}:2",
            "--dtype",
            "bfloat16",
            "--out",
            tmp_path / "fresh",
        )
        == 0
    )
    assert_tensors_equal(read_tensors(tmp_path / "fresh"), read_tensors(tmp_path / "swapped"))
    assert run("info", tmp_path / "swapped") == 0
    assert "merged: code weight=2" in capsys.readouterr().out


def test_list_and_info_show_the_store(tmp_path, adapter_dirs, capsys):
    store = tmp_path / "store"
    store.mkdir()
    for name in ("legal", "med"):
        shutil.copytree(adapter_dirs[name], store / name)
    shutil.copytree(adapter_dirs["med"], store / ".mix.partial-4242")  # a killed writer's staging: no adapter
    assert run("list", store) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3, lines
    assert lines[0].split() == ["NAME", "BASE", "RANK", "TARGETS", "SIZE", "METRICS"]
    assert lines[1].split()[0] == "legal" and "q_proj,v_proj" in lines[1] and lines[1].split()[2] == "4"
    assert lines[2].split()[0] == "med" and "down_proj,o_proj,q_proj" in lines[2] and lines[2].split()[2] == "8"
    assert run("info", "med", "--store", store) == 0
    info = capsys.readouterr().out
    assert "adapter: med" in info and "rank: 8  alpha: 16" in info and "sha256:" in info
    assert run("list", store, "--json") == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(a["name"], a["ranks"]) for a in listed] == [("legal", [4]), ("med", [8])] and listed[0]["size_bytes"] > 0
    assert listed[0]["targets"] == ["q_proj", "v_proj"] and listed[0]["problem"] is None
    assert all(isinstance(value, (int, float)) for value in listed[0]["metrics"].values())
    # One broken adapter is a row saying what is wrong with it; the rest of the store is still listed.
    shutil.copytree(adapter_dirs["med"], store / "broken")
    (store / "broken" / "adapter_model.safetensors").write_bytes(b"x" * 100)
    assert run("list", store) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [row.split()[0] for row in rows[1:]] == ["broken", "legal", "med"] and "unreadable:" in rows[1]
    config = json.loads((store / "med" / "adapter_config.json").read_text())
    config["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # a mixture of experts'
    (store / "med" / "adapter_config.json").write_text(json.dumps(config))
    assert run("list", store) == 0
    assert "down_proj,o_proj,q_proj,experts.down_proj,experts.gate_up_proj" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("document", "fragment"),
    [
        ([1, 2], "holds a JSON list, not an object"),
        ({"rank_pattern": ["q_proj", 8]}, "rank_pattern is ['q_proj', 8], not an object"),
        ({"target_modules": 5}, "target_modules is 5, not a module name"),
        ({"target_modules": [1, 2]}, "target_modules is [1, 2]"),
        ({"r": "four"}, "r is 'four', not a whole number"),
        ({"r": None}, "r is None, not a whole number"),  # listed as rank None before
        ({"lora_alpha": "8"}, "lora_alpha is '8', not a number"),
    ],
    ids=[
        "a-list",
        "rank-pattern-a-list",
        "targets-a-number",
        "targets-numbers",
        "rank-words",
        "rank-null",
        "alpha-text",
    ],
)
def test_an_adapter_config_of_the_wrong_shape_is_one_line_naming_the_key(
    tmp_path, tiny_base_dir, adapter_dirs, capsys, document, fragment
):
    """A hand-edited adapter_config.json (a list, a key holding another type) is a problem row in `list`, and one
    line with exit 2 from `info` and `merge`, not an AttributeError or TypeError from inside the arithmetic."""
    store = tmp_path / "store"
    shutil.copytree(adapter_dirs["legal"], store / "legal")
    shutil.copytree(adapter_dirs["legal"], store / "odd")
    config_file = store / "odd" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(document if isinstance(document, list) else {**config, **document}))
    assert run("list", store, "--json") == 0
    listed = {row["path"]: row["problem"] for row in json.loads(capsys.readouterr().out)}
    assert listed[str(store / "legal")] is None and fragment in listed[str(store / "odd")]
    for argv in (
        ("info", store / "odd"),
        ("merge", "--base", tiny_base_dir, "--adapter", store / "odd", "--out", tmp_path / "o"),
    ):
        assert run(*argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and fragment in err[0], err
    assert not (tmp_path / "o").exists()


def test_info_shows_the_per_module_alphas_beside_the_adapters_alpha(tmp_path, tiny_base_dir, capsys):
    adapter = make_adapter(tiny_base_dir, tmp_path / "patterned", seed=3, r=4, alpha=8, alpha_pattern={"q_proj": 32})
    assert run("info", adapter) == 0
    assert "rank: 4  alpha: 8 (q_proj=32)  rslora" in capsys.readouterr().out


def test_ranks_are_listed_in_numeric_order(tmp_path, tiny_base_dir, capsys):
    """A rank_pattern (every combined adapter has one) gave "12/2/6" in the table, info and `--json`'s ranks."""
    store = tmp_path / "store"
    make_adapter(tiny_base_dir, store / "mixed", seed=3, r=2, targets=("q_proj", "v_proj", "o_proj"),
                 rank_pattern={"layers.0.self_attn.q_proj": 12, "layers.1.self_attn.v_proj": 6})  # fmt: skip
    assert run("list", store) == 0
    assert " 2/6/12 " in capsys.readouterr().out
    assert run("list", store, "--json") == 0
    assert json.loads(capsys.readouterr().out)[0]["ranks"] == [2, 6, 12]
    assert run("info", store / "mixed") == 0
    assert "rank: 2/6/12  alpha" in capsys.readouterr().out


def test_an_adapter_without_its_weights_file_is_a_problem_row_not_a_whole_adapter(tmp_path, adapter_dirs, capsys):
    """A directory with adapter_config.json and no weights (a copy cut short) was listed as healthy, 0 B."""
    store = tmp_path / "store"
    shutil.copytree(adapter_dirs["legal"], store / "cut")
    (store / "cut" / "adapter_model.safetensors").unlink()
    assert run("list", store, "--json") == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert "has adapter_config.json but no adapter_model.safetensors" in row["problem"]
    assert run("info", store / "cut") == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_an_adapter_of_another_peft_method_is_a_problem_row_and_info_refuses_it(tmp_path, tiny_base_dir, capsys):
    """IA3 and prefix-tuning adapters saved by plain peft: listed as a LoRA of rank "?" and alpha None (IA3), or as
    having "no target_modules ... re-save it with peft" (prefix tuning), where every command that uses them refuses
    them as not LoRA. Now the listing and `info` say what they are, as the commands do."""
    from peft import IA3Config, PrefixTuningConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    store = tmp_path / "store"
    configs = {
        "ia3": IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]),
        "prefix": PrefixTuningConfig(num_virtual_tokens=2, task_type="CAUSAL_LM"),
    }
    for name, config in configs.items():
        get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_base_dir), config).save_pretrained(store / name)
    assert run("list", store, "--json") == 0
    rows = {row["name"]: row["problem"] for row in json.loads(capsys.readouterr().out)}
    assert "peft_type 'IA3' is not LoRA" in rows["ia3"]
    assert "peft_type 'PREFIX_TUNING' is not LoRA" in rows["prefix"]
    for name in configs:
        assert run("info", store / name) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "is not LoRA; finetune takes LoRA adapters only" in line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["merge", "--base", "{base}", "--adapter", "{tmp}/missing", "--out", "{tmp}/o"],
            "missing: no such directory; give an adapter directory",
        ),
        (["merge", "--base", "{tmp}/nobase", "--adapter", "{legal}", "--out", "{tmp}/o"], "not a model directory"),
        (["subtract", "--model", "{base}", "--adapter", "{legal}", "--out", "{tmp}/o"], "task negation"),
        (["combine", "{legal}", "{med}", "--weights", "1", "--out", "{tmp}/o"], "1 values for 2 adapters"),
        (["info", "nothing-here", "--store", "{tmp}"], "neither a directory nor an adapter"),
        (["list", "{tmp}/nostore"], "no adapter store"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(tmp_path, tiny_base_dir, adapter_dirs, capsys, argv, message):
    values = {"base": tiny_base_dir, "tmp": tmp_path, "legal": adapter_dirs["legal"], "med": adapter_dirs["med"]}
    assert run(*[a.format(**values) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1], err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["subtract", "--model", "{two}", "--adapter", "legal", "--adapter", "med", "--out", "{tmp}/o"],
        ["swap", "--model", "{two}", "--remove", "legal", "--remove", "med", "--add", "{code}", "--out", "{tmp}/o"],
        ["swap", "--model", "{two}", "--remove", "legal", "--add", "{code}", "--add", "{med}", "--out", "{tmp}/o"],
    ],
)
def test_an_option_that_takes_one_adapter_given_twice_is_refused(tmp_path, tiny_base_dir, adapter_dirs, capsys, argv):
    """argparse keeps the last of repeated options: `subtract --adapter legal --adapter med` (repeated as merge's
    `--adapter` is) took out med alone and exited 0. Refused in one line, nothing written."""
    legal, med = adapter_dirs["legal"], adapter_dirs["med"]
    assert run("merge", "--base", tiny_base_dir, "--adapter", legal, "--adapter", med, "--out", tmp_path / "two") == 0
    capsys.readouterr()
    values = {"two": tmp_path / "two", "tmp": tmp_path, "code": adapter_dirs["code"], "med": med}
    with pytest.raises(SystemExit) as exited:
        run(*[a.format(**values) for a in argv])
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "given twice" in line and "run the command once per adapter" in line
    assert not (tmp_path / "o").exists()


def test_subprocess_exit_code_and_no_traceback(tmp_path, tiny_base_dir, adapter_dirs):
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "finetune",
            "adapters",
            "merge",
            "--base",
            str(tiny_base_dir),
            "--adapter",
            str(tmp_path / "missing"),
            "--out",
            str(tmp_path / "o"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr and "error: " in bad.stderr and "missing: no such directory" in bad.stderr


def test_a_killed_merge_leaves_no_directory_at_out(tmp_path, tiny_base_dir, adapter_dirs):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_base_dir).save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    out = tmp_path / "merged"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "finetune",
            "adapters",
            "merge",
            "--base",
            str(tmp_path / "sharded"),
            "--adapter",
            str(adapter_dirs["legal"]),
            "--out",
            str(out),
            "--force",
        ],
        cwd=REPO,
        env={**os.environ, SLOW_HOOK_ENV: "2"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 90
        while not any(p.glob("*.safetensors") for p in tmp_path.glob(".merged.partial-*")):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the merge never started writing"
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == -signal.SIGKILL
    assert not out.exists()  # only a stale .merged.partial-<pid> may remain


@pytest.mark.parametrize("name", ["legal", "med-2", "code_v3", "default", "A1"])
def test_valid_adapter_names(name):
    assert validate_adapter_name(name) == name


@pytest.mark.parametrize(
    "name", ["", "a/b", "..", "x.y", "lora", "a", "lora_", "training", "keys", "-x", "with space", "x" * 65]
)
def test_invalid_adapter_names_are_refused(name):
    with pytest.raises(AdapterError, match=f"adapter name {name!r}"):
        validate_adapter_name(name)


@pytest.mark.parametrize(
    ("directory", "derived"),
    [
        ("a", "a_adapter"),
        ("lora", "lora_adapter"),
        ("training", "training_adapter"),
        ("legal.v2", "legal_v2"),
        (".hidden", "hidden"),
    ],
)
def test_names_derived_from_directories_are_made_valid(tmp_path, adapter_dirs, directory, derived):
    """peft saves and loads an adapter from any directory, so its name alone must never make it unusable."""
    copy = tmp_path / directory
    shutil.copytree(adapter_dirs["legal"], copy)
    (copy / "manifest.json").unlink()  # the name then comes from the directory
    assert read_adapter(copy).name == derived


def test_merge_accepts_an_adapter_in_a_directory_named_a(tmp_path, adapter_dirs, tiny_base_dir):
    copy = tmp_path / "a"
    shutil.copytree(adapter_dirs["legal"], copy)
    (copy / "manifest.json").unlink()
    out = tmp_path / "merged"
    assert main(["adapters", "merge", "--base", str(tiny_base_dir), "--adapter", str(copy), "--out", str(out)]) == 0
    assert (out / "config.json").is_file()


def test_pickle_adapters_need_allow_pickle_and_load_weights_only(tmp_path, adapter_dirs):
    pickled = tmp_path / "pickled"
    shutil.copytree(adapter_dirs["legal"], pickled)
    torch.save(load_file(pickled / "adapter_model.safetensors"), pickled / "adapter_model.bin")
    (pickled / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="pickle file.*--allow-pickle"):
        read_adapter(pickled)
    allowed, reference = read_adapter(pickled, allow_pickle=True), read_adapter(adapter_dirs["legal"])
    for module, lora in reference.modules.items():
        assert torch.equal(allowed.modules[module].delta(), lora.delta())
    assert run("combine", pickled, adapter_dirs["med"], "--out", tmp_path / "o") == 2
    assert run("combine", pickled, adapter_dirs["med"], "--allow-pickle", "--out", tmp_path / "o") == 0


def test_nan_in_an_adapter_is_refused_naming_adapter_and_module(tmp_path, adapter_dirs):
    broken = tmp_path / "broken"
    shutil.copytree(adapter_dirs["legal"], broken)
    tensors = load_file(broken / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors[key][0, 0] = float("nan")
    save_file(tensors, broken / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="adapter 'legal' .*model.layers.1.self_attn.v_proj lora_B holds NaN or Inf"):
        read_adapter(broken)


def test_unsupported_lora_variants_are_refused_with_the_reason(tmp_path, adapter_dirs):
    variant = tmp_path / "modules_to_save"
    shutil.copytree(adapter_dirs["legal"], variant)
    config = json.loads((variant / "adapter_config.json").read_text())
    (variant / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": ["lm_head"]}))
    with pytest.raises(AdapterError, match="replaces whole modules"):
        read_adapter(variant)


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_an_adapter_saved_unconverted_from_a_base_rewriting_init_is_refused(tmp_path, tiny_base_dir, capsys, init):
    """peft's PiSSA/OLoRA init takes s·B₀A₀ out of the base weight; an adapter saved without peft's conversion is an
    update of that rewritten weight, so merged into the base on disk it would not be the trained model."""
    adapter = make_adapter(tiny_base_dir, tmp_path / init, seed=4, init_lora_weights=init, magnitude=0.05)
    capsys.readouterr()  # transformers' loading bar
    for command in (["merge", "--base", str(tiny_base_dir), "--adapter", str(adapter), "--out", str(tmp_path / "m")],
                    ["combine", str(adapter), str(adapter), "--out", str(tmp_path / "mix")]):  # fmt: skip
        assert main(["adapters", *command]) == 2
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and f"init_lora_weights is '{init}'" in error[0], error
    assert not (tmp_path / "m").exists() and not (tmp_path / "mix").exists()


def test_a_dora_adapter_is_used_unmerged_and_refused_by_adapter_arithmetic(workdir, capsys):
    """DoRA trains, and peft applies it unmerged: eval gives the run's own held-out loss. Its update depends on the
    norm of the weight it is added to, so merge, combine and GGUF export refuse it in one line (every command
    refused it, generate and eval included)."""
    import re

    from finetune.training.loop import train

    _, metrics = train("recipe.yaml", ["lora.use_dora=true", "lora.dropout=0", "train.max_steps=4"])
    assert main(["eval", "--adapter", "adapters/crates", "--data", "valid.jsonl", "--format", "instruction",
                 "--max-seq-len", "128"]) == 0  # fmt: skip
    tuned = float(re.search(r"loss ([\d.]+)", capsys.readouterr().out.strip().splitlines()[-1])[1])
    assert abs(tuned - metrics["eval_loss"]) < 2e-3, (tuned, metrics["eval_loss"])
    assert main(["generate", "--adapter", "adapters/crates", "--max-new-tokens", "4", "the model"]) == 0
    for command in (["adapters", "merge", "--base", str(read_adapter("adapters/crates").base_path), "--adapter",
                     "adapters/crates", "--out", "merged"],
                    ["adapters", "combine", "adapters/crates", "adapters/crates", "--out", "mix"],
                    ["export", "gguf", "--adapter", "adapters/crates", "--out", "lora.gguf"]):  # fmt: skip
        assert main(command) == 2
        assert "use_dora is set" in capsys.readouterr().err
    assert not any(Path(name).exists() for name in ("merged", "mix", "lora.gguf"))


def test_warnings_are_printed_as_one_line(tmp_path, tiny_base_dir, capsys):
    from helpers import make_adapter

    plain = make_adapter(tiny_base_dir, tmp_path / "plain", seed=9, manifest=False)
    assert run("merge", "--base", tiny_base_dir, "--adapter", plain, "--out", tmp_path / "o") == 0
    err = capsys.readouterr().err.splitlines()
    assert (
        f"warning: adapter 'plain' ({plain}) has no manifest.json, so whether it was trained on {tiny_base_dir} cannot be checked"
        in err
    )


def test_a_grpo_adapter_is_listed_by_its_sampled_reward(tmp_path, tiny_base_dir):
    """A GRPO run's evaluation loss and perplexity are of completions it sampled itself: `adapters list` shows
    its held-out reward first, and not those (it showed eval_ppl=12.93 base_eval_ppl=10.65 eval_loss=-0.0015)."""
    from helpers import make_adapter

    from finetune.adapters.store import summarize
    from finetune.manifest import read_manifest, write_manifest

    path = make_adapter(tiny_base_dir, tmp_path / "grpo", seed=3, targets=("q_proj",))
    metrics = {"eval_ppl": 12.93, "base_eval_ppl": 10.65, "eval_loss": -0.0015, "eval_reward": -0.5,
               "base_eval_reward": -0.875, "step": 30, "reward": -0.4}  # fmt: skip
    write_manifest(path, read_manifest(path).model_copy(update={"metrics": metrics}))
    assert summarize(path).metrics == "eval_reward=-0.5 base_eval_reward=-0.875 step=30"


def _human_info(text: str) -> dict:
    """`adapters info`'s lines as the figures they state, to compare with `--json`."""
    stated: dict = {"metrics": {}, "combined_from": [], "merged": []}
    for line in text.splitlines():
        key, _, value = line.partition(": ")
        if key == "rank":
            rank, alpha = value.split("  alpha: ")
            stated["ranks"] = [int(r) for r in rank.split("/")]
            stated["alpha"] = float(alpha.split()[0])
            stated["rslora"], stated["dora"] = "rslora: True" in value, "dora: True" in value
        elif key in ("combined from", "merged"):
            name, weight, source = value.replace(" weight=", " ").replace(" from ", " ").split(" ")
            stated[key.replace(" ", "_")].append((name, float(weight), source))
        elif key.startswith("metric "):
            stated["metrics"][key.removeprefix("metric ")] = value
        else:
            stated[key] = value
    return stated


def _info_both(target) -> tuple[dict, dict]:
    """The human lines (parsed) and the `--json` object of one `adapters info`, each exit 0 and stdout only."""
    result = [
        subprocess.run([sys.executable, "-m", "finetune", "adapters", "info", str(target), *flags],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
        for flags in ((), ("--json",))
    ]  # fmt: skip
    assert [r.returncode for r in result] == [0, 0] and "Traceback" not in result[1].stderr, result
    return _human_info(result[0].stdout), json.loads(result[1].stdout)


def test_info_json_of_an_adapter_states_the_human_lines_figures(tmp_path, tiny_base_dir):
    """`info --json`: one object holding what the lines say (ranks of a rank_pattern, per-module alphas, base,
    quantization, data, metrics), and what they leave out (modules_to_save, the recipe)."""
    from finetune.manifest import DataInfo, read_manifest, write_manifest

    path = make_adapter(tiny_base_dir, tmp_path / "legal", seed=3, r=2, alpha=8, targets=("q_proj", "v_proj"),
                        rank_pattern={"layers.0.self_attn.q_proj": 6}, alpha_pattern={"q_proj": 32},
                        modules_to_save=["lm_head"], quantization="4bit", base_dtype="bfloat16")  # fmt: skip
    data = DataInfo(fingerprint="sha256:feed", sources=["train.jsonl", "more.jsonl"])
    update = {"metrics": {"eval_ppl": 3.5, "eval_loss": float("nan"), "step": 30}, "data": data,
              "recipe": {"model": {"quantization": "4bit", "quant_type": "nf4"}}, "created": "2026-01-02T03:04:05+00:00"}  # fmt: skip
    write_manifest(path, read_manifest(path).model_copy(update=update))
    human, info = _info_both(path)
    assert info["kind"] == "adapter" and (info["name"], info["path"]) == (human["adapter"], human["path"]) == (
        "legal",
        str(path),
    )
    assert (
        info["ranks"] == human["ranks"] == [2, 6]
        and info["rank"] == 2
        and info["rank_pattern"] == {"layers.0.self_attn.q_proj": 6}
    )
    assert info["alpha"] == human["alpha"] == 8 and info["alpha_pattern"] == {"q_proj": 32}
    assert (info["rslora"], info["dora"]) == (human["rslora"], human["dora"]) == (False, False)
    assert ",".join(info["targets"]) == human["targets"] == "q_proj,v_proj" and info["modules_to_save"] == ["lm_head"]
    assert human["size"] == f"{info['size_bytes'] / 1024:.1f} KiB"
    base = info["base"]
    assert human["base"] == f"{base['id']} at {base['path']} ({base['fingerprint']})" and base[
        "fingerprint"
    ].startswith("sha256:")
    assert (base["quantization"], base["dtype"]) == ("4bit", "bfloat16") and "trained on a 4bit base" in human
    assert human["data"] == f"{info['data']['fingerprint']} {', '.join(info['data']['sources'])}"
    assert info["metrics"] == {"eval_ppl": 3.5, "eval_loss": None, "step": 30}
    assert human["metrics"] == {"eval_ppl": "3.5", "eval_loss": "None", "step": "30"}  # a NaN is written as null
    assert info["recipe"] == update["recipe"] and info["created"] == human["created"]
    assert info["combined_from"] is None and human["combined_from"] == []


def test_info_json_of_a_combined_adapter_and_a_merged_model(tmp_path, tiny_base_dir, adapter_dirs):
    """A combined adapter's inputs (once printed as a Python list of dicts: one readable line each now) and a
    merged model's ledger and stored dtype, the same in the lines and in `--json`; no manifest, no fingerprint."""
    legal, med = adapter_dirs["legal"], adapter_dirs["med"]
    assert run("combine", legal, med, "--weights", "1,-0.5", "--out", tmp_path / "mix") == 0
    human, info = _info_both(tmp_path / "mix")
    assert human["combined_from"] == [("legal", 1.0, str(legal.resolve())), ("med", -0.5, str(med.resolve()))]
    assert [(s["name"], s["weight"], s["path"]) for s in info["combined_from"]] == human["combined_from"]
    assert all(len(s["sha256"]) == 64 for s in info["combined_from"]) and info["combine_method"] == "cat"
    assert info["ranks"] == human["ranks"] == [4, 8, 12] and set(info["rank_pattern"].values()) == {4, 8}
    merge = ("merge", "--base", tiny_base_dir, "--adapter", legal, "--adapter", f"{med}:0.5", "--dtype", "bfloat16")
    assert run(*merge, "--out", tmp_path / "merged") == 0
    human, info = _info_both(tmp_path / "merged")
    assert info["kind"] == "merged_model" and human["merged model"] == info["path"] == str(tmp_path / "merged")
    assert (
        human["base"] == f"{info['base']['path']} ({info['base']['fingerprint']})"
        and info["base"]["quantization"] == "none"
    )
    assert [(e["name"], e["weight"], e["path"]) for e in info["merged"]] == human["merged"]
    assert human["merged"] == [("legal", 1.0, str(legal.resolve())), ("med", 0.5, str(med.resolve()))]
    assert all(len(e["sha256"]) == 64 for e in info["merged"]) and (info["dtype"], info["dtypes"]) == (
        "bfloat16",
        ["bfloat16"],
    )
    plain = make_adapter(tiny_base_dir, tmp_path / "plain", seed=4, manifest=False)
    human, info = _info_both(plain)
    assert info["base"] == {"id": str(tiny_base_dir), "path": None, "revision": None, "fingerprint": None,
                            "dtype": None, "quantization": None} and str(tiny_base_dir) in human["base"]  # fmt: skip
    assert (info["recipe"], info["data"], info["metrics"], info["combined_from"]) == (None, None, {}, None)


def test_info_json_piped_into_head_and_its_errors(tmp_path, adapter_dirs, capsys):
    """`info --json | head -c 10` exits 0 without a word on stderr; a hand-edited combined_from and a truncated
    merged shard are one line, exit 2, with and without --json."""
    piped = subprocess.run(
        ["bash", "-c", f'"{sys.executable}" -m finetune adapters info "{adapter_dirs["med"]}" --json | head -c 10; '
                       'exit "${PIPESTATUS[0]}"'],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (piped.returncode, piped.stdout, piped.stderr) == (0, '{\n  "kind"', ""), piped
    from finetune.manifest import read_manifest, write_manifest

    odd = shutil.copytree(adapter_dirs["legal"], tmp_path / "odd")
    write_manifest(odd, read_manifest(odd).model_copy(update={"combined_from": "legal and med"}))
    for flags in ((), ("--json",)):
        assert run("info", odd, *flags) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "combined_from is 'legal and med', not a list of {name, path, weight, sha256}" in line
    old = [{"name": "legal", "path": "legal", "weight": 2}]  # combined before the sha256 was kept: still shown
    write_manifest(odd, read_manifest(odd).model_copy(update={"combined_from": old}))
    assert run("info", odd) == 0 and "combined from: legal weight=2 from legal" in capsys.readouterr().out
    assert run("info", odd, "--json") == 0
    assert json.loads(capsys.readouterr().out)["combined_from"] == [{**old[0], "sha256": None}]
    (tmp_path / "merged").mkdir()
    ledger = '{"base": {"path": "b"}, "adapters": {"legal": {"weight": 1}}}'
    (tmp_path / "merged" / "config.json").write_text(json.dumps({"finetune_merged": ledger}))
    (tmp_path / "merged" / "model.safetensors").write_bytes(b"x" * 100)  # a shard cut short
    assert run("info", tmp_path / "merged", "--json") == 2
    assert "model.safetensors: its header claims" in capsys.readouterr().err


def test_list_and_info_name_the_layers_the_adapter_holds_lora_for(tmp_path, tiny_base_dir, capsys):
    """`targets` came from peft's `target_modules`, which says what was asked: a recipe's `exclude_modules: [down_proj]`
    left down_proj in it (listed, though the adapter has no LoRA there), and `train_lm_head` makes it a regex,
    which `list` and `info` printed as the targets (`info --json`: a one-element list holding the regex). Now the
    layers are read from the weights file's header."""
    make_adapter(tiny_base_dir, tmp_path / "store" / "excluded", seed=1, targets=("q_proj", "down_proj"),
                 exclude_modules=["down_proj"])  # fmt: skip
    make_adapter(
        tiny_base_dir, tmp_path / "store" / "head", seed=2, targets=(), target_modules=r"(?:.*\.)?(?:v_proj)|lm_head"
    )
    assert run("list", str(tmp_path / "store"), "--json") == 0
    listed = {a["name"]: a["targets"] for a in json.loads(capsys.readouterr().out)}
    assert listed == {"excluded": ["q_proj"], "head": ["lm_head", "v_proj"]}
    assert run("info", str(tmp_path / "store" / "head")) == 0
    assert "targets: lm_head,v_proj\n" in capsys.readouterr().out


def test_a_directory_holding_named_adapters_says_which_to_give(tmp_path, tiny_base_dir, adapter_dirs, capsys):
    """peft saves an adapter not named "default" under its name (`save_pretrained(out)` of "legal" writes
    out/legal/): given `out`, every command said only that it is no adapter, not where the adapter is."""
    out = tmp_path / "out"
    shutil.copytree(adapter_dirs["legal"], out / "legal")
    assert run("info", out) == 2
    assert f"it holds adapters in its subdirectories ({out / 'legal'}): give one of them" in capsys.readouterr().err
    with pytest.raises(AdapterError, match=r"no adapter_config.json\); it holds adapters in its subdirectories"):
        read_adapter(out)
