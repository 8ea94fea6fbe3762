"""Benchmark: exact in-place adapter swap, and drift after merge/unmerge cycles, ours vs peft.

Not a test: it prints figures for bench/README.md. Three parts, on a random Llama built from a config
(default hidden 768, 12 layers, intermediate 2048, vocab 32000: 134M parameters) and two LoRA adapters
(r=16, alpha=32, all linear layers, random non-zero A and B, saved by peft):

1. swap: `LoadedModel.swap(a, b)` in place, against what a user does without it (reload the base from
   disk + `PeftModel.from_pretrained(b)` + `merge_and_unload`) and against peft's own in-place
   `unmerge_adapter()` + `merge_adapter(["b"])` (fast but not exact). Seconds (median of --repeats), the
   ratio, and whether the result equals a fresh merge of b bit for bit (`torch.equal`, every targeted weight).
2. drift: --cycles merge/unmerge cycles of one adapter; max |W − W0| over every targeted weight, ours
   (`merge`/`subtract`, restored from the memory-mapped base files: target exactly 0) vs peft's
   `merge_adapter`/`unmerge_adapter`.
3. memory: resident memory (VmRSS, and its anonymous part) of a process holding the base only, ours
   after merge + swap, and a model that keeps a second copy of the targeted weights to restore them.
   Each is measured in its own subprocess.

Run (from the repository root; about 6 minutes on 2 CPU cores with the defaults):
    python bench/adapter_swap.py --scratch /tmp/bench-models
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
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
    memory_status,
    mib,
    parameter_count,
    print_table,
    versions,
)

ADAPTER_NAMES = ("legal", "med")  # what LoadedModel calls the two adapters; peft gets the same names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16,float32", help="dtypes of the swap timing (comma-separated)")
    parser.add_argument("--drift-dtypes", default="bfloat16,float16,float32")
    parser.add_argument("--cycles", type=int, default=100, help="merge/unmerge cycles of the drift part")
    parser.add_argument(
        "--drift-layers",
        type=int,
        default=2,
        help="drift part: adapter on the linear layers of the first N decoder layers only (0: all)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions of each swap (median reported)")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/bench-models"), help="where models are built")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: swap,drift,memory")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as JSON here")
    parser.add_argument("--memory-probe", choices=["base", "ours", "copy"], help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---- setup -----------------------------------------------------------------------------------------
def model_paths(args: argparse.Namespace) -> tuple[Path, dict[str, Path]]:
    stem = f"llama-h{args.hidden}-l{args.layers}-i{args.intermediate}"
    base = args.scratch / stem
    return base, {name: args.scratch / f"{stem}-lora-{name}" for name in ADAPTER_NAMES}


def prepare(args: argparse.Namespace) -> tuple[Path, dict[str, Path], int]:
    from transformers import AutoModelForCausalLM

    args.scratch.mkdir(parents=True, exist_ok=True)
    base, adapters = model_paths(args)
    build_base(base, hidden=args.hidden, layers=args.layers, intermediate=args.intermediate)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    for seed, path in enumerate(adapters.values(), start=1):
        build_adapter(base, path, seed=seed, model=model)
    return base, adapters, parameter_count(model)


def drift_adapter(args: argparse.Namespace, base: Path, full: Path) -> Path:
    """The first adapter restricted to the first --drift-layers decoder layers (same A, B), or itself."""
    if args.drift_layers <= 0 or args.drift_layers >= args.layers:
        return full
    from safetensors.torch import load_file, save_file

    out = full.with_name(full.name + f"-first{args.drift_layers}")
    if not (out / "adapter_model.safetensors").is_file():
        out.mkdir(parents=True, exist_ok=True)
        keep = tuple(f".layers.{i}." for i in range(args.drift_layers))
        tensors = load_file(str(full / "adapter_model.safetensors"))
        save_file(
            {k: v for k, v in tensors.items() if any(s in k for s in keep)}, str(out / "adapter_model.safetensors")
        )
        config = json.loads((full / "adapter_config.json").read_text())
        config["layers_to_transform"] = list(range(args.drift_layers))  # peft adds LoRA layers there only
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def load_ours(base: Path, adapters: dict[str, Path], dtype: str):
    import finetune

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no manifest.json": these adapters were not trained by finetune
        return finetune.load_model(str(base), adapters={n: str(p) for n, p in adapters.items()}, dtype=dtype)


def load_peft(base: Path, adapters: dict[str, Path], dtype: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype))
    names = list(adapters)
    peft_model = PeftModel.from_pretrained(model, str(adapters[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(str(adapters[name]), adapter_name=name)
    return peft_model


def targeted_weights(model, modules: list[str]) -> dict[str, torch.Tensor]:
    """module -> its base weight tensor (live, not a copy), looking through peft's LoRA wrappers."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    weights = {}
    for module in modules:
        layer = inner.get_submodule(module)
        layer = getattr(layer, "base_layer", layer)
        weights[module] = layer.weight.data
    return weights


def compare(ours: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> tuple[bool, float]:
    """(every tensor equal bit for bit, max abs difference)."""
    equal, worst = True, 0.0
    for name, tensor in ours.items():
        equal = equal and torch.equal(tensor, other[name])
        worst = max(worst, (tensor.float() - other[name].float()).abs().max().item())
    return equal, worst


def timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


# ---- part 1: swap ----------------------------------------------------------------------------------
def bench_swap(base: Path, adapters: dict[str, Path], dtype: str, repeats: int) -> dict:
    """Time the three ways of going from a to b, interleaved per repetition so load from other processes
    hits them alike; then compare each result with ours and ours with a fresh merge of b."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    old, new = ADAPTER_NAMES
    ours = load_ours(base, adapters, dtype)
    modules = sorted(ours.adapters[new].modules)
    ours.merge(old)
    peft_model = load_peft(base, adapters, dtype)
    peft_model.merge_adapter([old])

    def reload_and_merge():
        model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype))
        return PeftModel.from_pretrained(model, str(adapters[new]), adapter_name=new).merge_and_unload()

    seconds: dict[str, list[float]] = {"ours": [], "reload": [], "peft": []}
    reloaded = None
    for i in range(repeats):  # a -> b, then b -> a, ...: every in-place call is one full swap
        a, b = (old, new) if i % 2 == 0 else (new, old)
        seconds["ours"].append(timed(lambda a=a, b=b: ours.swap(a, b)))
        del reloaded
        started = time.perf_counter()
        reloaded = reload_and_merge()
        seconds["reload"].append(time.perf_counter() - started)
        seconds["peft"].append(timed(lambda b=b, model=peft_model: (model.unmerge_adapter(), model.merge_adapter([b]))))
    if ours.merged != {new: 1.0}:  # an even number of repeats ends on a: one more swap each, untimed
        ours.swap(old, new)
        peft_model.unmerge_adapter(), peft_model.merge_adapter([new])
    ours_weights = targeted_weights(ours.model, modules)
    equal_reload, diff_reload = compare(ours_weights, targeted_weights(reloaded, modules))
    equal_peft, diff_peft = compare(ours_weights, targeted_weights(peft_model, modules))
    del reloaded, peft_model

    fresh = load_ours(base, {new: adapters[new]}, dtype)
    fresh.merge(new)
    equal_fresh, diff_fresh = compare(ours_weights, targeted_weights(fresh.model, modules))
    del fresh
    return {
        "dtype": dtype,
        "targeted_weights": len(modules),
        "ours_swap_s": statistics.median(seconds["ours"]),
        "reload_merge_s": statistics.median(seconds["reload"]),
        "peft_inplace_s": statistics.median(seconds["peft"]),
        "best_s": {method: min(values) for method, values in seconds.items()},
        "all_seconds": seconds,
        "ours_equals_fresh_merge": equal_fresh,
        "ours_vs_fresh_max_abs": diff_fresh,
        "ours_equals_peft_reload": equal_reload,
        "ours_vs_peft_reload_max_abs": diff_reload,
        "ours_equals_peft_inplace": equal_peft,
        "ours_vs_peft_inplace_max_abs": diff_peft,
    }


# ---- part 2: drift ---------------------------------------------------------------------------------
def bench_drift(base: Path, adapter: Path, dtype: str, cycles: int) -> dict:
    name = ADAPTER_NAMES[0]
    ours = load_ours(base, {name: adapter}, dtype)
    modules = sorted(ours.adapters[name].modules)
    live = targeted_weights(ours.model, modules)
    original = {m: w.clone() for m, w in live.items()}
    ours_after = {}
    started = time.perf_counter()
    for cycle in range(1, cycles + 1):
        ours.merge(name)
        ours.subtract(name)
        if cycle in (1, cycles):
            ours_after[cycle] = compare(original, live)
    ours_seconds = time.perf_counter() - started
    del ours, live

    peft_model = load_peft(base, {name: adapter}, dtype)
    live = targeted_weights(peft_model, modules)
    assert all(torch.equal(original[m], live[m]) for m in modules), "peft loaded another base than ours"
    peft_after = {}
    started = time.perf_counter()
    for cycle in range(1, cycles + 1):
        peft_model.merge_adapter()
        peft_model.unmerge_adapter()
        if cycle in (1, cycles):
            peft_after[cycle] = compare(original, live)
    peft_seconds = time.perf_counter() - started
    return {
        "dtype": dtype,
        "cycles": cycles,
        "targeted_weights": len(modules),
        "targeted_elements": sum(w.numel() for w in original.values()),
        "ours_max_abs_after_1": ours_after[1][1],
        "ours_max_abs_after_n": ours_after[cycles][1],
        "ours_bit_exact_after_n": ours_after[cycles][0],
        "peft_max_abs_after_1": peft_after[1][1],
        "peft_max_abs_after_n": peft_after[cycles][1],
        "peft_bit_exact_after_n": peft_after[cycles][0],
        "ours_seconds_per_cycle": ours_seconds / cycles,
        "peft_seconds_per_cycle": peft_seconds / cycles,
    }


# ---- part 3: memory, one subprocess per probe ------------------------------------------------------
def memory_probe(args: argparse.Namespace) -> None:
    """Runs in a subprocess: load, do the probe's work, print memory_status() as JSON."""
    from transformers import AutoModelForCausalLM

    base, adapters = model_paths(args)
    dtype = args.dtype.split(",")[0]
    extra = 0
    if args.memory_probe == "base":
        model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype))
        # Touch every weight: a memory-mapped one is not resident until read (as after a forward pass).
        sum(float(p.float().sum()) for p in model.parameters())
    elif args.memory_probe == "ours":
        loaded = load_ours(base, adapters, dtype)
        loaded.merge(ADAPTER_NAMES[0])
        loaded.swap(*ADAPTER_NAMES)
        extra = loaded.pristine_copy_bytes
    else:  # the alternative to memory-mapped files: keep a copy of every targeted weight, then merge
        loaded = load_ours(base, adapters, dtype)
        modules = sorted(loaded.adapters[ADAPTER_NAMES[0]].modules)
        kept = {m: w.clone() for m, w in targeted_weights(loaded.model, modules).items()}
        loaded.merge(ADAPTER_NAMES[0])
        loaded.swap(*ADAPTER_NAMES)
        extra = sum(t.numel() * t.element_size() for t in kept.values())
    print(json.dumps({**memory_status(), "kept_copy_bytes": extra}))


def bench_memory(args: argparse.Namespace, dtype: str) -> dict:
    figures = {"dtype": dtype}
    for probe in ("base", "ours", "copy"):
        command = [
            sys.executable,
            __file__,
            "--memory-probe",
            probe,
            "--dtype",
            dtype,
            "--hidden",
            str(args.hidden),
            "--layers",
            str(args.layers),
            "--intermediate",
            str(args.intermediate),
            "--scratch",
            str(args.scratch),
        ]
        result = subprocess.run(command, capture_output=True, text=True, check=True)
        figures[probe] = json.loads(result.stdout.strip().splitlines()[-1])
    return figures


def quiet() -> None:
    """No progress bars or deprecation warnings from transformers/peft in the printed tables."""
    import transformers

    warnings.simplefilter("ignore")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


# ---- report ----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_grad_enabled(False)
    quiet()
    if args.memory_probe:
        memory_probe(args)
        return
    skip = set(filter(None, args.skip.split(",")))
    base, adapters, parameters = prepare(args)
    figures: dict = {
        "versions": versions(),
        "parameters": parameters,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    figures["load_average_start"] = load_average()
    print(f"# adapter_swap  {figures['date']}\n{figures['versions']}; load average {figures['load_average_start']}")
    print(
        f"base {base}: Llama hidden {args.hidden}, {args.layers} layers, intermediate {args.intermediate}: "
        f"{parameters / 1e6:.1f}M parameters; adapters r=16 all-linear\n",
        flush=True,
    )

    if "swap" not in skip:
        figures["swap"] = []
        rows = []
        for dtype in args.dtype.split(","):
            result = bench_swap(base, adapters, dtype, args.repeats)
            figures["swap"].append(result)
            ours, best = result["ours_swap_s"], result["best_s"]

            def row(
                label: str,
                key: str,
                method: str,
                equal: str,
                diff: str,
                dtype=dtype,
                result=result,
                ours=ours,
                best=best,
            ) -> list[str]:
                return [
                    dtype,
                    label,
                    f"{result[key]:.2f}",
                    f"{result[key] / ours:.2f}x",
                    f"{best[method]:.2f}",
                    f"{best[method] / best['ours']:.2f}x",
                    f"{result[equal]} (max |Δ| {result[diff]:.1e})",
                ]

            rows += [
                row(
                    "ours: LoadedModel.swap(a, b), in place",
                    "ours_swap_s",
                    "ours",
                    "ours_equals_fresh_merge",
                    "ours_vs_fresh_max_abs",
                ),
                row(
                    "reload base + PeftModel(b) + merge_and_unload",
                    "reload_merge_s",
                    "reload",
                    "ours_equals_peft_reload",
                    "ours_vs_peft_reload_max_abs",
                ),
                row(
                    "peft in place: unmerge_adapter + merge_adapter([b])",
                    "peft_inplace_s",
                    "peft",
                    "ours_equals_peft_inplace",
                    "ours_vs_peft_inplace_max_abs",
                ),
            ]
            print(f"swap {dtype} done", flush=True)
        print(
            f"\n## swap a -> b ({figures['swap'][0]['targeted_weights']} targeted weights; median and best of "
            f"{args.repeats}, interleaved)"
        )
        print(
            "the last column compares each result with ours; ours vs a fresh `load_model` + merge(b) on the first line"
        )
        print_table(
            rows, ["dtype", "method", "median s", "median / ours", "best s", "best / ours", "bit-equal to ours' result"]
        )
        print(flush=True)

    if "drift" not in skip:
        adapter = drift_adapter(args, base, adapters[ADAPTER_NAMES[0]])
        figures["drift"] = []
        rows = []
        for dtype in args.drift_dtypes.split(","):
            result = bench_drift(base, adapter, dtype, args.cycles)
            figures["drift"].append(result)
            rows.append(
                [
                    dtype,
                    f"{result['ours_max_abs_after_1']:.1e}",
                    f"{result['ours_max_abs_after_n']:.1e}",
                    str(result["ours_bit_exact_after_n"]),
                    f"{result['peft_max_abs_after_1']:.1e}",
                    f"{result['peft_max_abs_after_n']:.1e}",
                    f"{result['ours_seconds_per_cycle']:.2f}",
                    f"{result['peft_seconds_per_cycle']:.2f}",
                ]
            )
            print(f"drift {dtype} done", flush=True)
        r = figures["drift"][0]
        print(
            f"\n## drift: max |W - W0| over {r['targeted_weights']} targeted weights ({r['targeted_elements'] / 1e6:.1f}M "
            f"elements) after merge/unmerge cycles"
        )
        n = args.cycles
        print_table(
            rows,
            [
                "dtype",
                "ours 1",
                f"ours {n}",
                f"ours == W0 after {n}",
                "peft 1",
                f"peft {n}",
                "ours s/cycle",
                "peft s/cycle",
            ],
        )
        print(flush=True)

    if "memory" not in skip:
        figures["memory"] = []
        rows = []
        for dtype in args.dtype.split(","):
            result = bench_memory(args, dtype)
            figures["memory"].append(result)
            for probe, label in (
                ("base", "base model only (from_pretrained, every weight read)"),
                ("ours", "ours: load_model + merge + swap"),
                ("copy", "ours + a kept copy of the targeted weights"),
            ):
                m = result[probe]
                rows.append(
                    [
                        dtype,
                        label,
                        mib(m["rss"]),
                        mib(m["anon"]),
                        mib(m["file"]),
                        mib(m["kept_copy_bytes"]) if probe != "base" else "-",
                    ]
                )
        print("\n## resident memory after merge + swap (each in its own process)")
        print_table(rows, ["dtype", "process", "RSS", "anon", "file-backed", "in-memory copy"])
    figures["load_average_end"] = load_average()
    print(
        f"\nload average (1, 5, 15 min) at start {figures['load_average_start']}, at end {figures['load_average_end']} "
        f"on {os.cpu_count()} cores: timings are shared with whatever else runs"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
