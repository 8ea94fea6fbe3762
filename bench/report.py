"""The Markdown summary of a `python -m bench` run (bench/results/latest.md), from its latest.json.

Only formatting: every figure is read from the JSON the scripts wrote, so the summary and the JSON
cannot disagree. A part that failed gets a line saying so instead of a table.

Example:
    markdown = format_markdown(json.loads(Path("bench/results/latest.json").read_text()))
"""

from __future__ import annotations

from typing import Any

ARM_LABELS = {
    "ours-packed": "ours, packed",
    "ours-padded": "ours, padded",
    "hf-trainer": "HF Trainer + peft (padded to the longest)",
    "hf-trainer-liger": "HF Trainer + peft + Liger Kernel (`use_liger_kernel`)",
}


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def percent(value: float | None) -> str:
    """A fraction as a percentage; "n/a" where it has no meaning (MFU per CPU second on a GPU)."""
    return "n/a" if value is None else f"{value:.1%}"


def loads(values: list[float]) -> str:
    return "/".join(f"{v:.1f}" for v in values)


def gpu_words(machine: dict[str, Any]) -> str:
    """Which GPU the run saw: train_throughput's arms train on it, the other parts stay on the CPU."""
    if not machine["gpu"]:
        return "no GPU"
    return f"GPU {machine.get('gpu_name') or '(unnamed)'}: the training arms ran on it, swap and merge on the CPU"


def machine_lines(report: dict[str, Any]) -> list[str]:
    m = report["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    minutes, seconds = divmod(round(report["wall_seconds"]), 60)
    lines = [
        f"{report['date_utc']}; {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB RAM, {gpu_words(m)}; {versions}.",
        f"`{report['command']}`: {minutes} min {seconds} s. Load average (1/5/15 min) at the start "
        f"{loads(report['load_average_start'])}, at the end {loads(report['load_average_end'])}.",
    ]
    peak_load = max(max(p["load_average_before"][0], p["load_average_after"][0]) for p in report["parts"].values())
    if peak_load > m["cores"] / 2:
        lines.append(
            f"\n**Taken under load** (1-minute load average up to {peak_load:.1f} on {m['cores']} cores): "
            "seconds and tokens per second are depressed and noisy; ratios come from interleaved runs; "
            "exactness, drift, losses and memory do not depend on load. Re-run on a quiet machine before quoting speeds."
        )
    if report["quick"]:
        lines.append("\n**`--quick`**: tiny models, a check that the command works; the figures mean little.")
    return lines


def peak_words(peak: dict[str, Any]) -> str:
    """The matmul peak MFU is taken against: a CPU's per wall and per CPU second, a GPU's per wall second."""
    best = peak["best"]
    if "flops_per_cpu_s" not in best:
        return f"{best['flops_per_s'] / 1e12:.1f} TFLOP/s on the GPU"
    return f"{best['flops_per_s'] / 1e9:.1f} GFLOP/s, {best['flops_per_cpu_s'] / 1e9:.1f} GFLOP per CPU s"


def train_section(figures: dict[str, Any]) -> list[str]:
    spec, results, ratios = figures["spec"], figures["results"], figures["median_ratios"]
    m, d = spec["model"], spec["data"]
    peak = figures["matmul_peak"]
    lines = [
        f"One epoch of {d['train_records']} generated instruction records (median {d['median_tokens']}, p90 "
        f"{d['p90_tokens']}, max {d['max_tokens']} tokens): {spec['steps']} optimizer steps of "
        f"{spec['micro_batch_size'] * spec['grad_accum_steps']} documents (micro-batch {spec['micro_batch_size']} "
        f"x accumulation {spec['grad_accum_steps']}), the last {spec['steps'] - spec['warmup_steps']} timed; "
        f"Llama {m['parameters'] / 1e6:.1f}M parameters (hidden {m['hidden']}, {m['layers']} layers, vocabulary "
        f"{m['vocab']}, {'tied' if m['tied_embeddings'] else 'untied'} embeddings), LoRA r=16 all-linear, "
        f"{spec['precision']}, {spec['torch_threads']} torch threads; {len(figures['rounds'])} interleaved rounds.",
        f"Matmul peak ({peak['precision']}, same threads, best of before and after the arms): {peak_words(peak)}. "
        "MFU = model FLOPs per second (bench/flops.py: real tokens, attention per document) over that peak.",
        "",
    ]
    rows = []
    for arm, result in results.items():
        vs = ratios.get("tokens_per_s", {}).get(arm)
        vs_cpu = ratios.get("tokens_per_cpu_s", {}).get(arm)
        rows.append(
            [
                ARM_LABELS.get(arm, arm),
                f"{result['tokens_per_s']:.0f}",
                f"{vs:.2f}x" if vs is not None else "1.00x",
                f"{vs_cpu:.2f}x" if vs_cpu is not None else "1.00x",
                f"{result['mfu']:.1%}",
                percent(result["mfu_per_cpu_s"]),
                f"{result['padding_fraction']:.1%}",
                f"{result['peak_rss_mib']:.0f}",
                f"{result['heldout_loss']:.4f}",
            ]
        )
    lines += table(
        [
            "arm",
            "real tokens/s",
            "vs Trainer (median of rounds)",
            "per CPU s vs Trainer",
            "MFU",
            "MFU per CPU s",
            "padding computed",
            "peak RSS MiB",
            "held-out loss",
        ],
        rows,
    )
    lines.append(
        "\nTokens/s, MFU and memory are each arm's median round; the ratios are medians over rounds of each "
        "round's ratio. Every arm takes the same documents per step, so model FLOPs per step are equal."
    )
    lines += skipped_arms(figures)
    lines += [f"\nWARNING: {w}" for w in figures.get("warnings", [])]
    return lines


def swap_section(figures: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if "swap" in figures:
        first = figures["swap"][0]
        repeats = len(first["all_seconds"]["ours"])
        lines += [
            f"Llama {figures['parameters'] / 1e6:.1f}M parameters, two LoRA adapters (r=16, all-linear, "
            f"{first['targeted_weights']} weights); swap a -> b, median of {repeats} interleaved repetitions.",
            "",
        ]
        rows = [
            [
                r["dtype"],
                f"{r['ours_swap_s']:.2f}",
                f"{r['reload_merge_s']:.2f} ({r['reload_merge_s'] / r['ours_swap_s']:.1f}x)",
                f"{r['peft_inplace_s']:.2f} ({r['peft_inplace_s'] / r['ours_swap_s']:.1f}x)",
                str(r["ours_equals_fresh_merge"]),
                f"{r['ours_equals_peft_inplace']} (max abs diff {r['ours_vs_peft_inplace_max_abs']:.1e})",
            ]
            for r in figures["swap"]
        ]
        lines += table(
            [
                "dtype",
                "ours: in-place swap s",
                "reload base + merge b s",
                "peft unmerge + merge s",
                "ours = fresh merge of b",
                "peft in place = ours",
            ],
            rows,
        )
    if "drift" in figures:
        first = figures["drift"][0]
        lines += [
            "",
            f"Drift: max |W - W0| over {first['targeted_weights']} weights after merge/unmerge cycles.",
            "",
        ]
        rows = [
            [
                r["dtype"],
                f"{r['ours_max_abs_after_n']:.1e}",
                str(r["ours_bit_exact_after_n"]),
                f"{r['peft_max_abs_after_1']:.1e}",
                f"{r['peft_max_abs_after_n']:.1e}",
            ]
            for r in figures["drift"]
        ]
        cycles = first["cycles"]
        lines += table(["dtype", f"ours after {cycles}", "ours == W0", "peft after 1", f"peft after {cycles}"], rows)
    return lines


def merge_section(figures: dict[str, Any]) -> list[str]:
    ours, peft, floor, comparison = figures["ours"], figures["baseline"], figures["floor"], figures["comparison"]
    gib = 2**30
    lines = [
        f"A {figures['checkpoint_bytes'] / 1e9:.2f} GB {figures['dtype']} checkpoint in {figures['shards']} shards "
        f"(largest {figures['largest_shard_bytes'] / 2**20:.0f} MiB), one adapter; each run a subprocess.",
        "",
    ]
    rows = [
        [label, f"{r['peak_rss'] / gib:.2f}", f"{r['peak_anon'] / gib:.2f}", f"{r['seconds']:.1f}"]
        for label, r in (
            ("ours: `finetune adapters merge` (streaming)", ours),
            ("peft: from_pretrained + merge_and_unload + save_pretrained", peft),
            ("floor: python + imports", floor),
        )
    ]
    lines += table(["process", "peak RSS GiB", "peak anonymous GiB", "wall s"], rows)
    lines.append(
        f"\nAbove the floor, peak anonymous memory: ours {(ours['peak_anon'] - floor['peak_anon']) / gib:.2f} GiB, "
        f"peft {(peft['peak_anon'] - floor['peak_anon']) / gib:.2f} GiB (RSS also counts memory-mapped file pages, "
        "which the kernel can drop). "
        f"Peak RSS ours / peft {ours['peak_rss'] / peft['peak_rss']:.2f}; ours loads with from_pretrained: "
        f"{figures['ours_loads']}; {comparison['elements_differing']} of {comparison['elements']} elements differ "
        f"from peft's merge (max abs diff {comparison['max_abs_diff']:.1e})."
    )
    return lines


GPU_HEADER = [
    "arm",
    "real tokens/s",
    "vs Trainer (median of rounds)",
    "MFU",
    "peak GiB",
    "plan GiB",
    "plan / measured",
    "held-out loss",
]


def gib(num_bytes: float | None) -> str:
    return "n/a" if num_bytes is None else f"{num_bytes / 2**30:.2f}"


def gpu_rows(figures: dict[str, Any]) -> list[list[str]]:
    """One row per arm of a GPU preset's figures, in `GPU_HEADER`'s columns. Peak GiB is
    `torch.cuda.max_memory_allocated` up to the arm's last step ("n/a" on a CPU); plan GiB is `finetune plan`'s
    peak less its runtime part (the CUDA context, which that counter does not see)."""
    ratios = figures["median_ratios"].get("tokens_per_s", {})
    rows = []
    for arm, result in figures["results"].items():
        vs = ratios.get(arm, 1.0 if arm == "hf-trainer" else None)
        over = result.get("plan_over_measured")
        rows.append(
            [
                ARM_LABELS.get(arm, arm),
                f"{result['tokens_per_s']:.0f}",
                "n/a" if vs is None else f"{vs:.2f}x",
                percent(result["mfu"]),
                gib(result.get("peak_gpu_bytes")),
                gib(result.get("plan_bytes")),
                "n/a" if over is None else f"{over:.2f}",
                f"{result['heldout_loss']:.4f}",
            ]
        )
    return rows


def preset_section(figures: dict[str, Any]) -> list[str]:
    """A GPU preset (train_throughput.py --preset): what ran, on what, and its rows."""
    spec, m, plan = figures["spec"], figures["spec"]["model"], figures.get("plan") or {}
    rows_per_step = spec["micro_batch_size"] * spec["grad_accum_steps"]
    lines = [
        f"{m.get('base_config', 'Llama')}: {m['parameters']:,} parameters (random weights, vocabulary "
        f"{m['vocab']:,}), base {spec['model_dtype']}"
        + (", nf4 4-bit" if spec["quantization"] == "4bit" else "")
        + (", gradient checkpointing" if spec["gradient_checkpointing"] else "")
        + f"; LoRA r=16 all-linear, {spec['precision']}; {spec['steps']} steps of {rows_per_step} documents "
        f"(micro-batch {spec['micro_batch_size']} x accumulation {spec['grad_accum_steps']}, up to "
        f"{spec['seq_len']} tokens each, median {spec['data']['median_tokens']}), the last "
        f"{spec['steps'] - spec['warmup_steps']} timed; on {spec['device']}"
        + (f" ({figures['gpu']})" if figures.get("gpu") else "")
        + f"; {len(figures['rounds'])} interleaved round(s).",
        f"Matmul peak ({figures['matmul_peak']['precision']}, best of before and after the arms): "
        f"{peak_words(figures['matmul_peak'])}. `finetune plan` for ours' recipe: {gib(plan.get('peak_bytes'))} "
        f"GiB, {gib(plan.get('comparable_bytes'))} GiB without its runtime part.",
        "",
    ]
    lines += table(GPU_HEADER, gpu_rows(figures))
    lines += skipped_arms(figures)
    lines += [f"\nWARNING: {w}" for w in figures.get("warnings", [])]
    return lines


def skipped_arms(figures: dict[str, Any]) -> list[str]:
    """One line per arm asked for that could not run here, with the reason (e.g. Liger without CUDA)."""
    return [f"\nNot run: {ARM_LABELS.get(arm, arm)}: {why}." for arm, why in figures.get("skipped_arms", {}).items()]


def startup_section(figures: dict[str, Any]) -> list[str]:
    lines = [f"Median of {figures['repeats']} fresh processes on {figures['cpu']}, {figures['cores']} cores.", ""]
    return lines + table(
        ["command", "seconds"],
        [
            ["`finetune --help` (wall)", f"{figures['help_seconds']:.2f}"],
            ["`finetune generate`, 40 tokens, embedded base + adapter (wall)", f"{figures['generate_seconds']:.2f}"],
            ["imports of a one-step `finetune train`", f"{figures['train_import_seconds']:.2f}"],
        ],
    )


def host_section(figures: dict[str, Any]) -> list[str]:
    rows = [[name, f"{f['aten_ops_per_step']:,.0f}", f"{f['syncs_per_step']:.1f}", str(f["shapes_per_epoch"])]
            for name, f in figures.items()]  # fmt: skip
    lines = table(["arm", "aten ops/step", "syncs/step", "shapes/epoch"], rows)
    ours, theirs = figures.get("ours"), figures.get("hf-trainer + peft")
    if ours and theirs:
        ratio = ours["aten_ops_per_step"] / theirs["aten_ops_per_step"]
        lines += ["", f"ours / Trainer, aten ops per step: {ratio:.2f}x (goal: 0.3x); ours reads its metrics once per "
                  f"logging interval ({ours.get('syncs_per_logging_read', 0)} syncing ops per read)"]  # fmt: skip
    return lines


SECTIONS = {
    "train": ("Training throughput and utilisation (bench/train_throughput.py)", train_section),
    "swap": ("Adapter swap and drift (bench/adapter_swap.py)", swap_section),
    "merge": ("Streaming merge (bench/streaming_merge.py)", merge_section),
    "startup": ("Start-up (bench/startup.py)", startup_section),
    "host": ("Host work per optimizer step, ours against the HF Trainer + peft (bench/host_work.py)", host_section),
}


def section_of(name: str) -> tuple[str, Any]:
    """A part's title and formatter: the CPU parts by name, every other part is a GPU preset."""
    return SECTIONS.get(name) or (f"GPU preset {name} (bench/train_throughput.py --preset {name})", preset_section)


def format_markdown(report: dict[str, Any]) -> str:
    lines = ["# `python -m bench`", "", *machine_lines(report)]
    for name, part in report["parts"].items():
        title, section = section_of(name)
        lines += ["", f"## {title}", "", f"`{part['command']}`", ""]
        lines += section(part["figures"]) if "figures" in part else [f"**Failed**: {part['error']}"]
    lines += ["", "## Parts", ""]
    lines += table(
        ["part", "wall s", "load average before", "after"],
        [
            [name, f"{p['wall_seconds']:.0f}", loads(p["load_average_before"]), loads(p["load_average_after"])]
            for name, p in report["parts"].items()
        ],
    )
    return "\n".join(lines) + "\n"
