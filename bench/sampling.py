"""Time GRPO's sampler three ways: the lean decode step over merged copies, over the model's own weights, and the
model's own forward.

The embedded base with a LoRA (r 16 on every linear layer of the blocks, B drawn as if trained), 8 rows of one
prompt, 96 tokens each at temperature 1 (no stop token, so every row writes all 96); the median of `--repeats`
calls after one warm-up call. The three ways are chosen the way a run would meet them: `merged` as sampling
does by default; `own weights` with `lean_decoder.MEMORY_SHARE` set to 0, as for a base whose copy would not
fit; `model forward` with a forward pre-hook that does nothing on the head, which the lean step declines for
(a hook could change what the module computes). Printed: seconds per call and whether each way drew the same
tokens as the merged one (the same uniforms; logits a few ulps apart may move a draw).

Example:
    python bench/sampling.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout: `python bench/sampling.py`
    sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import finetune.generation.lean_decoder as lean_decoder
    from finetune.embedded.cache import resolve_base_id
    from finetune.generation.sample import SampleSettings, sample_completions

    base = resolve_base_id("embedded:tiny-llama")
    prompt = AutoTokenizer.from_pretrained(base)("### Instruction:\nWrite the weather bulletin.\n\n### Response:\n")
    torch.manual_seed(0)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora).eval()
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_(0, 0.02)
    prompts = [prompt["input_ids"]] * args.rows
    settings = SampleSettings(max_new_tokens=args.tokens)
    uniforms = torch.rand(args.rows, args.tokens, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def timed() -> tuple[float, list[list[int]]]:
        sample_completions(model, prompts, settings, stop_ids=set(), pad_token_id=0, uniforms=uniforms)  # warm-up
        seconds = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            tokens = sample_completions(model, prompts, settings, stop_ids=set(), pad_token_id=0, uniforms=uniforms)
            seconds.append(time.perf_counter() - started)
        return statistics.median(seconds), tokens

    results = {}
    merged_s, merged_tokens = timed()
    results["merged"] = {"seconds": merged_s, "same_tokens": True}
    share = lean_decoder.MEMORY_SHARE
    lean_decoder.MEMORY_SHARE = 0.0
    own_s, own_tokens = timed()
    lean_decoder.MEMORY_SHARE = share
    results["own weights"] = {"seconds": own_s, "same_tokens": own_tokens == merged_tokens}
    hook = model.get_base_model().lm_head.register_forward_pre_hook(lambda module, inputs: None)
    forward_s, forward_tokens = timed()
    hook.remove()
    results["model forward"] = {"seconds": forward_s, "same_tokens": forward_tokens == merged_tokens}
    for name, result in results.items():
        print(f"{name}: {json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()})}")


if __name__ == "__main__":
    main()
