"""bf16 on a CPU without bf16 units: the flags read from /proc/cpuinfo, and the one line `finetune plan` and
`finetune train` print naming the faster settings. The live checks hold on any machine: they expect the
note exactly when this CPU lists no bf16 flag (the Intel Xeon without AMX these tests were written on)."""

from __future__ import annotations

import json

import pytest

from finetune.cli import main
from finetune.cpu_features import bf16_cpu_note, cpu_flags, has_bf16_units

# Abridged /proc/cpuinfo of the three CPU kinds this project has run on, and an Arm server with BF16.
INTEL_AMX = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8\n"
INTEL_AVX512 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n"
AMD_AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve sve2 i8mm bf16 svebf16\n"
ARM_OLD = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes crc32\n"


@pytest.mark.parametrize(
    "cpuinfo, units",
    [(INTEL_AMX, True), (ARM_BF16, True), (INTEL_AVX512, False), (AMD_AVX2, False), (ARM_OLD, False), ("", None)],
    ids=["intel-amx", "arm-bf16", "intel-avx512", "amd-avx2", "arm-v8.0", "no-flags"],
)
def test_bf16_units_are_read_from_the_cpu_flags(cpuinfo, units):
    assert has_bf16_units(cpuinfo) is units


def test_the_note_names_what_was_asked_and_the_faster_setting():
    both = bf16_cpu_note("bfloat16", "bf16", device="cpu", cpuinfo=AMD_AVX2)
    assert both is not None and "\n" not in both
    assert "model.dtype=bfloat16 train.precision=bf16 asked for it" in both
    assert both.endswith("model.dtype=float32 train.precision=fp32 is faster")
    dtype_only = bf16_cpu_note("bfloat16", "fp32", device="cpu", cpuinfo=INTEL_AVX512)
    assert dtype_only is not None and dtype_only.endswith("model.dtype=float32 is faster")
    assert bf16_cpu_note("bfloat16", "bf16", device="cpu", cpuinfo=INTEL_AMX) is None  # AMX: bf16 is the fast one
    assert bf16_cpu_note("bfloat16", "bf16", device="cuda", cpuinfo=AMD_AVX2) is None  # a GPU's bf16 is its own
    assert bf16_cpu_note("float32", "fp32", device="cpu", cpuinfo=AMD_AVX2) is None  # nothing asked
    assert bf16_cpu_note("bfloat16", "bf16", device="cpu", cpuinfo="") is None  # unknown CPU: say nothing


def test_finetune_plan_says_it_in_text_and_json_on_this_cpu(capsys):
    expected = has_bf16_units() is False  # True on the Intel Xeon without AMX and on the AMD EPYC
    assert cpu_flags() is not None  # Linux: the live check below is not vacuous
    assert main(["plan", "qwen3-0.6b-chat", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert ("model.dtype=float32 train.precision=fp32 is faster" in text) is expected, text
    assert main(["plan", "qwen3-0.6b-chat", "--device", "cpu", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]  # also the CPU heap's, at this recipe's micro-batch
    assert sum("no bf16 units" in note for note in notes) == expected, notes


class _Loaded(Exception):
    """Raised from the log once the base is loaded: what the test reads is said by then."""


def test_the_training_log_says_it_on_this_cpu(workdir):
    from finetune.training.loop import train

    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        if line.startswith("trainable "):  # LoRA is on: the base was loaded, and the note said, before it
            raise _Loaded

    with pytest.raises(_Loaded):
        train("recipe.yaml", ["model.dtype=bfloat16"], log=log)
    notes = [line for line in lines if "no bf16 units" in line]
    assert len(notes) == (has_bf16_units() is False), lines
    assert all(note.endswith("model.dtype=float32 is faster") for note in notes)


@pytest.mark.parametrize(
    ("device", "units", "dtype", "precision"),
    [("cpu", False, "float32", "fp32"), ("cpu", True, "bfloat16", "bf16"), ("cuda", None, "bfloat16", "bf16")],
)
def test_auto_picks_16_bits_only_where_they_are_fast(workdir, device, units, dtype, precision):
    from finetune.recipe import load_recipe

    recipe = load_recipe("recipe.yaml", ["model.dtype=auto", "train.precision=auto"])
    resolved = recipe.for_device(device, bf16_units=units)
    assert (resolved.model.dtype, resolved.train.precision) == (dtype, precision)
    explicit = load_recipe("recipe.yaml", ["model.dtype=bfloat16"]).for_device(device, bf16_units=units)
    assert explicit.model.dtype == "bfloat16" and explicit.train.precision == "fp32"  # what a recipe says stays


def test_a_run_with_auto_trains_in_what_this_cpu_computes_fast(workdir, capsys):
    from finetune.manifest import read_manifest
    from finetune.training.loop import train

    adapter, _ = train("recipe.yaml", ["model.dtype=auto", "train.precision=auto", "train.max_steps=1"],
                       log=lambda line: None)  # fmt: skip
    expected = "bfloat16" if has_bf16_units() else "float32"
    assert read_manifest(adapter).recipe["model"]["dtype"] == expected
    assert main(["plan", "recipe.yaml", "model.dtype=auto", "--device", "cpu", "--json"]) == 0
    weights = json.loads(capsys.readouterr().out)["parts"]["weights"]["note"]
    assert weights.endswith(expected)
