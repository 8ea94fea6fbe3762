"""Shared pieces of the adapter benchmarks: build a random Llama and LoRA adapters on disk, measure memory.

Nothing here is downloaded: the base is a `LlamaForCausalLM` built from a config with random weights and
saved with `save_pretrained`; adapters are real peft `LoraModel`s with random non-zero A and B, saved
with peft's `save_pretrained`. Everything goes under a scratch directory outside the repository.

Example:
    base = build_base(Path("/tmp/bench-models/llama-134m"), hidden=768, layers=12, intermediate=2048)
    adapter = build_adapter(base, Path("/tmp/bench-models/llama-134m-a"), seed=1)
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

VOCAB_SIZE = 32000
LORA_RANK = 16
LORA_ALPHA = 32
# Std of the random A and B: with alpha/r = 2 and r = 16, ΔW has std 2·4·0.02² ≈ 3e-3, about 15% of a
# Llama-initialised weight (std 0.02): the size of a real fine-tune's update, so rounding behaves as in use.
LORA_INIT_STD = 0.02


def versions() -> str:
    import peft
    import safetensors
    import transformers

    return (
        f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"peft {peft.__version__}, safetensors {safetensors.__version__}; {os.cpu_count()} CPU threads"
    )


def build_base(
    out_dir: Path,
    *,
    hidden: int,
    layers: int,
    intermediate: int,
    heads: int | None = None,
    vocab_size: int = VOCAB_SIZE,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str = "500MB",
    seed: int = 0,
) -> Path:
    """A random Llama saved with `save_pretrained` (+ a small local tokenizer); reused if already built."""
    if (out_dir / "config.json").is_file() and any(out_dir.glob("*.safetensors")):
        return out_dir
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.embedded.tokenizer import train_tokenizer

    heads = heads or max(1, hidden // 64)
    tokenizer = train_tokenizer(["def f(x):\n    return x + 1\n", "The quick brown fox jumps.\n"] * 50, vocab_size=300)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    started = time.perf_counter()
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(dtype)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    model.save_pretrained(tmp, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)
    print(
        f"built {out_dir}: {parameter_count(model) / 1e6:.1f}M parameters in {time.perf_counter() - started:.1f} s",
        flush=True,
    )
    return out_dir


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build_adapter(base_dir: Path, out_dir: Path, *, seed: int, model=None) -> Path:
    """A LoRA adapter (r=16, all-linear) with random non-zero A and B, saved by peft; reused if present.

    `model` (the base, already loaded) saves reloading it; the LoRA layers are removed again afterwards.
    """
    if (out_dir / "adapter_model.safetensors").is_file():
        return out_dir
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * LORA_INIT_STD)
    peft_model.save_pretrained(out_dir)
    config_file = out_dir / "adapter_config.json"
    adapter_config = json.loads(config_file.read_text())
    adapter_config["base_model_name_or_path"] = str(base_dir)
    config_file.write_text(json.dumps(adapter_config, indent=2))
    peft_model.unload()  # leaves `model` as the plain base again
    return out_dir


def dir_bytes(directory: Path, pattern: str = "*.safetensors") -> tuple[int, int]:
    """(total bytes, largest file bytes) of the files matching `pattern`."""
    sizes = [p.stat().st_size for p in Path(directory).glob(pattern)]
    return sum(sizes), max(sizes, default=0)


def memory_status(pid: int | None = None) -> dict[str, int]:
    """Resident bytes of a process from /proc: total (VmRSS), anonymous, file-backed, and the kernel's peak (VmHWM)."""
    fields = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "VmHWM": "peak_rss"}
    status = {}
    with open(f"/proc/{pid or os.getpid()}/status") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key in fields:
                status[fields[key]] = int(value.split()[0]) * 1024
    return status


def run_measured(command: list[str], *, env: dict | None = None, poll_seconds: float = 0.02) -> dict:
    """Run `command` under /usr/bin/time, sampling its memory; returns seconds, peak RSS, peak anonymous RSS.

    peak_rss is the kernel's maximum resident set size of the command (GNU time's %M, exact);
    peak_anon is the largest anonymous RSS sampled every `poll_seconds` (memory the process allocated
    itself, without the memory-mapped file pages the OS can drop at will); peak_file likewise for those.
    """
    import tempfile

    import psutil

    with tempfile.NamedTemporaryFile("r", suffix=".time") as time_file:
        started = time.perf_counter()
        process = subprocess.Popen(
            ["/usr/bin/time", "-f", "%M", "-o", time_file.name, *command],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        peaks = {"peak_anon": 0, "peak_file": 0}
        done = threading.Event()

        def sample() -> None:
            wrapper = psutil.Process(process.pid)
            while not done.is_set():
                try:
                    for child in wrapper.children(recursive=True):
                        status = memory_status(child.pid)
                        peaks["peak_anon"] = max(peaks["peak_anon"], status.get("anon", 0))
                        peaks["peak_file"] = max(peaks["peak_file"], status.get("file", 0))
                except (psutil.Error, FileNotFoundError, ProcessLookupError, ValueError):
                    pass
                time.sleep(poll_seconds)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        output, _ = process.communicate()
        seconds = time.perf_counter() - started
        done.set()
        sampler.join()
        if process.returncode != 0:
            sys.stderr.write(output)
            raise SystemExit(f"command failed ({process.returncode}): {' '.join(command)}")
        max_rss_kib = int(time_file.read().strip().splitlines()[-1])
    return {"seconds": seconds, "output": output, "peak_rss": max_rss_kib * 1024, **peaks}


def warm_page_cache(paths: list[Path]) -> None:
    """Read files once so every measured run starts with them in the page cache (a fair, warm start)."""
    for path in paths:
        with open(path, "rb") as handle:
            while handle.read(64 << 20):
                pass


def gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.2f} GiB"


def mib(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:.0f} MiB"


def print_table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    print(line)
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
