"""Whether this CPU computes bf16 in hardware, and the one-line note when a recipe asks for bf16 without it.

bf16 matmul on a CPU is fast only with bf16 units: x86's `avx512_bf16` (Cooper Lake, Zen 4) or
`amx_bf16` (Sapphire Rapids and later), Arm's `bf16` (Neoverse V1/N2, Graviton 3). Without them torch
emulates it: on an AMD EPYC with AVX2 only, bf16 matmul ran at 0.76 GFLOP/s against fp32's 65 (86x
slower), on an Intel Xeon with AVX-512 and no AMX about 3x slower (6 against 20 GFLOP/s, 1024² on 2
threads, under load); an Intel Xeon with AMX ran bf16 at 706 GFLOP/s, 3x its fp32. So a recipe written for a GPU
(`model.dtype: bfloat16`, `train.precision: bf16`) and run on such a CPU is slow for no gain, and
`finetune train` and `finetune plan` say so, naming the faster settings.

The flags are read from /proc/cpuinfo (Linux); elsewhere nothing is known and nothing is said.

Example:
    note = bf16_cpu_note(recipe.model.dtype, recipe.train.precision, device="cpu")
    if note: say(note)   # "this CPU has no bf16 units ...; model.dtype=float32 train.precision=fp32 is faster"
"""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
"""x86 AVX-512 BF16, x86 AMX BF16, Arm BF16 (FEAT_BF16): any one of them computes bf16 in hardware."""


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str] | None:
    """The feature flags of /proc/cpuinfo (x86 `flags`, Arm `Features`), or of the text given; None when
    the file cannot be read (not Linux) or lists no flags."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text(errors="replace")
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return frozenset(value.split())
    return None


def has_bf16_units(cpuinfo: str | None = None) -> bool | None:
    """True when the CPU lists a bf16 flag, False when it lists flags but none for bf16, None when unknown."""
    flags = cpu_flags(cpuinfo)
    if flags is None:
        return None
    return any(flag in flags for flag in BF16_FLAGS)


def bf16_cpu_note(dtype: str, precision: str, *, device: str, cpuinfo: str | None = None) -> str | None:
    """One line naming the faster settings when bf16 is asked for on a CPU without bf16 units, else None.

    Args:
        dtype: the recipe's `model.dtype`.
        precision: the recipe's `train.precision`.
        device: `cpu` or `cuda` (a GPU's bf16 is its own matter: nothing is said).
    """
    if device != "cpu":
        return None
    asked = [f"model.dtype={dtype}"] * (dtype == "bfloat16") + [f"train.precision={precision}"] * (precision == "bf16")
    if not asked or has_bf16_units(cpuinfo) is not False:
        return None
    faster = ["model.dtype=float32"] * (dtype == "bfloat16") + ["train.precision=fp32"] * (precision == "bf16")
    return (
        f"this CPU has no bf16 units ({', '.join(BF16_FLAGS)} absent from /proc/cpuinfo): bf16 matmul is emulated, "
        f"3x to 86x slower than float32 on such CPUs; {' '.join(asked)} asked for it, {' '.join(faster)} is faster"
    )
