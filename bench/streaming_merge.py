"""Benchmark: peak memory of the streaming on-disk merge vs the usual peft merge, on a multi-GB checkpoint.

Not a test: it prints figures for bench/README.md. It builds a random Llama checkpoint (default hidden
2048, 12 layers, intermediate 5504, vocab 32000, fp32: 738M parameters, 2.95 GB in ~500 MB shards) and
a LoRA adapter for it (r=16, all linear layers, random non-zero A and B, saved by peft), then runs, each
as its own subprocess under /usr/bin/time:

- ours:     `python -m finetune adapters merge --base B --adapter A --out DIR` (shard by shard);
- baseline: `AutoModelForCausalLM.from_pretrained` + `PeftModel.from_pretrained` + `merge_and_unload`
            + `save_pretrained` (same shard size as the base).

It reports the peak RSS of each (GNU time's maximum resident set size) and the peak of its anonymous part
(sampled every 20 ms: memory the process allocated, not memory-mapped file pages the OS can drop), wall
time, checkpoint size and largest shard; then checks that our output loads with `from_pretrained` and
compares it with the baseline's tensor by tensor (max abs difference). Both round once: ours computes
round(W + (B·scale)·A) in fp32, peft (whose LoRA weights stay fp32) adds (B·A)·scale in place; the two
products can differ in the last fp32 bit when scale is not a power of two, hence "to within rounding".
Both runs start with the base files in the page cache (they are read once beforehand).

Run (from the repository root; about 5 minutes on 2 CPU cores, plus building the checkpoint once):
    python bench/streaming_merge.py --scratch /tmp/bench-models
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
from common import (  # noqa: E402
    build_adapter,
    build_base,
    dir_bytes,
    gib,
    mib,
    print_table,
    run_measured,
    versions,
    warm_page_cache,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=5504)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="dtype the checkpoint is stored in",
    )
    parser.add_argument("--shard-size", default="500MB", help="max_shard_size of the base (and the baseline's output)")
    parser.add_argument(
        "--moe",
        type=int,
        default=0,
        metavar="EXPERTS",
        help="a Qwen3-MoE base of this many experts per layer (top-4, expert width --intermediate) with LoRA on "
        "every expert tensor too, instead of a Llama",
    )
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/bench-models"), help="where models are built")
    parser.add_argument("--keep", action="store_true", help="keep the two merged outputs (deleted by default)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as JSON here")
    parser.add_argument("--baseline-child", nargs=3, metavar=("BASE", "ADAPTER", "OUT"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def quiet() -> None:
    import transformers

    warnings.simplefilter("ignore")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def baseline_child(base: str, adapter: str, out: str, dtype: str, shard_size: str) -> None:
    """The usual way, in this (measured) process: load everything, merge in memory, save."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype))
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out, max_shard_size=shard_size)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)


def build(args: argparse.Namespace) -> tuple[Path, Path]:
    """The checkpoint and its adapter, built once and reused (building is not measured)."""
    from transformers import AutoModelForCausalLM

    if args.moe:
        return build_moe(args)
    stem = f"llama-h{args.hidden}-l{args.layers}-i{args.intermediate}-{args.dtype}-shard{args.shard_size}"
    base = build_base(
        args.scratch / stem,
        hidden=args.hidden,
        layers=args.layers,
        intermediate=args.intermediate,
        dtype=getattr(torch, args.dtype),
        max_shard_size=args.shard_size,
    )
    adapter = args.scratch / f"{stem}-lora"
    if not (adapter / "adapter_model.safetensors").is_file():
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)  # LoRA weights in fp32
        build_adapter(base, adapter, seed=1, model=model)
        del model
    return base, adapter


def build_moe(args: argparse.Namespace) -> tuple[Path, Path]:
    """A random Qwen3-MoE checkpoint (fused 3D experts, as transformers 5 holds them) and a LoRA on every linear
    layer and expert tensor, as `finetune train` targets them (`finetune.model.wrap_with_lora`)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from finetune.embedded.tokenizer import train_tokenizer
    from finetune.model import wrap_with_lora
    from finetune.recipe import LoraConfig

    stem = (
        f"qwen3moe-h{args.hidden}-l{args.layers}-e{args.moe}-i{args.intermediate}-{args.dtype}-shard{args.shard_size}"
    )
    base, adapter = args.scratch / stem, args.scratch / f"{stem}-lora"
    if not (base / "config.json").is_file():
        tokenizer = train_tokenizer(["The quick brown fox jumps.\n"] * 50, vocab_size=300)
        config = Qwen3MoeConfig(
            vocab_size=32000, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=16,
            num_key_value_heads=4, head_dim=args.hidden // 16, moe_intermediate_size=args.intermediate,
            num_experts=args.moe, num_experts_per_tok=4, tie_word_embeddings=False,
        )  # fmt: skip
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).save_pretrained(
            base, max_shard_size=args.shard_size
        )
        tokenizer.save_pretrained(base)
    if not (adapter / "adapter_model.safetensors").is_file():
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft_model = wrap_with_lora(model, LoraConfig(r=16, alpha=32, dropout=0.0))
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, parameter in peft_model.named_parameters():
                if "lora_" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.01)
        peft_model.save_pretrained(adapter)
        del model, peft_model
    return base, adapter


def compare_outputs(ours: Path, theirs: Path) -> dict:
    """Tensor by tensor (streamed through safe_open): same names, max abs difference, elements that differ."""
    from safetensors import safe_open

    def index(directory: Path) -> dict[str, Path]:
        files = {}
        for path in sorted(directory.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                files.update({name: path for name in handle.keys()})
        return files

    ours_files, their_files = index(ours), index(theirs)
    result = {
        "same_names": set(ours_files) == set(their_files),
        "max_abs_diff": 0.0,
        "elements_differing": 0,
        "elements": 0,
        "tensors_differing": 0,
        "same_dtypes": True,
    }
    for name in sorted(set(ours_files) & set(their_files)):
        with (
            safe_open(str(ours_files[name]), framework="pt") as a,
            safe_open(str(their_files[name]), framework="pt") as b,
        ):
            x, y = a.get_tensor(name), b.get_tensor(name)
        result["same_dtypes"] &= x.dtype == y.dtype
        differing = int((x != y).sum())
        result["elements"] += x.numel()
        result["elements_differing"] += differing
        result["tensors_differing"] += differing > 0
        if differing:
            result["max_abs_diff"] = max(result["max_abs_diff"], (x.double() - y.double()).abs().max().item())
    return result


def loads_and_matches(ours: Path, dtype: str) -> bool:
    """Our output loads with from_pretrained, and the loaded weights equal the files (so no key was dropped)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ours, dtype=getattr(torch, dtype))
    state = model.state_dict()
    ok = True
    for path in sorted(ours.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                ok &= name in state and torch.equal(state[name], handle.get_tensor(name))
    return ok


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.baseline_child:
        baseline_child(*args.baseline_child, dtype=args.dtype, shard_size=args.shard_size)
        return
    quiet()
    args.scratch.mkdir(parents=True, exist_ok=True)
    base, adapter = build(args)
    total_bytes, largest_shard = dir_bytes(base)
    shards = len(list(base.glob("*.safetensors")))
    adapter_bytes, _ = dir_bytes(adapter)
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# streaming_merge  {date}\n{versions()}; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(
        f"base {base}: {total_bytes / 1e9:.2f} GB ({gib(total_bytes)}) in {shards} shards, largest "
        f"{mib(largest_shard)}; adapter {mib(adapter_bytes)} (r=16, all-linear)",
        flush=True,
    )
    if total_bytes < 2e9:
        print(f"note: the checkpoint is {total_bytes / 1e9:.2f} GB, below the 2 GB the issue asks for", flush=True)

    out_root = Path(tempfile.mkdtemp(prefix="merge-bench-", dir=args.scratch))
    ours_out, baseline_out = out_root / "ours", out_root / "baseline"
    env = dict(os.environ, PYTHONPATH=str(REPO), FINETUNE_HOME=str(out_root / "cache"))
    try:
        warm_page_cache(sorted(base.glob("*.safetensors")))
        ours = run_measured(
            [
                sys.executable,
                "-m",
                "finetune",
                "adapters",
                "merge",
                "--base",
                str(base),
                "--adapter",
                str(adapter),
                "--out",
                str(ours_out),
            ],
            env=env,
        )
        print(ours["output"].strip().splitlines()[-1], flush=True)
        reported = re.search(r"shard\(s\), (\d+) tensors with updates, ([\d.]+) s\)", ours["output"])
        warm_page_cache(sorted(base.glob("*.safetensors")))
        baseline = run_measured(
            [
                sys.executable,
                __file__,
                "--baseline-child",
                str(base),
                str(adapter),
                str(baseline_out),
                "--dtype",
                args.dtype,
                "--shard-size",
                args.shard_size,
            ],
            env=env,
        )
        print("baseline done", flush=True)

        # What the interpreter and imports alone hold. Both processes import all four: ours reads LoRA
        # scales with peft's pattern helpers, and importing peft imports transformers.
        floor = run_measured([sys.executable, "-c", "import torch, safetensors, transformers, peft"], env=env)
        comparison = compare_outputs(ours_out, baseline_out)
        loads = loads_and_matches(ours_out, args.dtype)
        ours_total, ours_largest = dir_bytes(ours_out)
        base_total, base_largest = dir_bytes(baseline_out)
    finally:
        if not args.keep:
            shutil.rmtree(out_root, ignore_errors=True)

    rows = [
        [
            "ours: finetune adapters merge (streaming)",
            gib(ours["peak_rss"]),
            gib(ours["peak_anon"]),
            f"{ours['seconds']:.1f}",
            f"{ours['peak_rss'] / largest_shard:.1f}x",
            mib(ours_largest),
        ],
        [
            "peft: from_pretrained + merge_and_unload + save_pretrained",
            gib(baseline["peak_rss"]),
            gib(baseline["peak_anon"]),
            f"{baseline['seconds']:.1f}",
            f"{baseline['peak_rss'] / largest_shard:.1f}x",
            mib(base_largest),
        ],
    ]
    print(
        f"\n## merge one adapter into a {total_bytes / 1e9:.2f} GB {args.dtype} checkpoint ({shards} shards, "
        f"largest {mib(largest_shard)}); each run a subprocess, base files in the page cache"
    )
    rows.append(
        [
            "floor: python + import torch, safetensors, transformers, peft",
            gib(floor["peak_rss"]),
            gib(floor["peak_anon"]),
            f"{floor['seconds']:.1f}",
            "-",
            "-",
        ]
    )
    print_table(
        rows, ["process", "peak RSS", "peak anon RSS", "wall s", "peak RSS / largest shard", "largest output shard"]
    )
    ours_above = ours["peak_anon"] - floor["peak_anon"]
    print(
        f"peak anonymous RSS above the floor: ours {gib(ours_above)} ({ours_above / largest_shard:.2f}x the largest "
        f"shard), peft {gib(baseline['peak_anon'] - floor['peak_anon'])} (checkpoint {gib(total_bytes)})"
    )
    print(
        f"peak RSS ours / peft: {ours['peak_rss'] / baseline['peak_rss']:.2f}; peak anon ours / peft: "
        f"{ours['peak_anon'] / baseline['peak_anon']:.2f}; wall time ours / peft: {ours['seconds'] / baseline['seconds']:.2f}"
    )
    if reported:
        print(
            f"ours: {reported[1]} tensors with updates; {reported[2]} s of the wall time writing shards, the rest is "
            "start-up and fingerprinting the base (sha256 of every tensor, cold cache)"
        )
    print(f"ours loads with from_pretrained and its weights equal its files: {loads}")
    print(
        f"ours vs peft's merged tensors: same names {comparison['same_names']}, same dtypes {comparison['same_dtypes']}, "
        f"max abs diff {comparison['max_abs_diff']:.2e}, {comparison['tensors_differing']} tensors / "
        f"{comparison['elements_differing']} of {comparison['elements']} elements differ"
    )
    figures = {
        "date": date,
        "versions": versions(),
        "base": str(base),
        "dtype": args.dtype,
        "checkpoint_bytes": total_bytes,
        "shards": shards,
        "largest_shard_bytes": largest_shard,
        "adapter_bytes": adapter_bytes,
        "ours": {k: v for k, v in ours.items() if k != "output"},
        "baseline": {k: v for k, v in baseline.items() if k != "output"},
        "floor": {k: v for k, v in floor.items() if k != "output"},
        "ours_output_bytes": ours_total,
        "baseline_output_bytes": base_total,
        "comparison": comparison,
        "ours_loads": loads,
        "ours_reported": ours["output"].strip(),
    }
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
