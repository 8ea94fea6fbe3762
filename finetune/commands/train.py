"""`finetune train RECIPE [key=value ...] [--resume]` and `finetune validate RECIPE [key=value ...]`.

Example:
    finetune train recipes/quickstart.yaml train.lr=1e-3 --resume
"""

from __future__ import annotations

import argparse
from typing import Any

from finetune.commands.warning_lines import warnings_as_lines
from finetune.errors import FinetuneError


def register(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser("train", help="fine-tune a LoRA adapter as a recipe says")
    train.add_argument("recipe", help="YAML recipe, e.g. recipes/quickstart.yaml")
    train.add_argument(
        "overrides", nargs="*", default=[], metavar="key=value", help="recipe overrides, e.g. train.lr=1e-4"
    )
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint of the run")
    train.add_argument(
        "--cpu", action="store_true", help="train on the CPU (CPU ranks over gloo with --nproc) even where GPUs are"
    )
    scale = train.add_argument_group("several processes (handed to accelerate launch)")
    scale.add_argument("--nproc", type=int, default=1, help="processes per node (GPUs, or CPU ranks over gloo)")
    scale.add_argument("--nnodes", type=int, default=1, help="number of nodes")
    scale.add_argument("--node-rank", type=int, default=0, help="this node's rank, 0 .. nnodes-1")
    scale.add_argument("--main-address", help="address of the rank-0 node (multi-node)")
    scale.add_argument("--main-port", type=int, help="port of the rank-0 node (default: a free one)")
    train.set_defaults(handler=warnings_as_lines(run_train))

    validate = subparsers.add_parser("validate", help="check a recipe (and overrides) without running it")
    validate.add_argument("recipe")
    validate.add_argument("overrides", nargs="*", default=[], metavar="key=value")
    validate.set_defaults(handler=warnings_as_lines(run_validate))


def run_train(args: argparse.Namespace) -> int:
    # Imported here, not at the top: `finetune --help` stays fast.
    from finetune.launched import already_launched
    from finetune.training.launch import check_gpu_count, hide_gpus, launch_command, run_launched
    from finetune.training.run_files import check_before_launch

    if args.nproc < 1 or args.nnodes < 1:
        raise FinetuneError(f"--nproc {args.nproc} --nnodes {args.nnodes}: both must be at least 1")
    if not 0 <= args.node_rank < args.nnodes:  # else the rendezvous waits for nodes that never come
        raise FinetuneError(f"--node-rank {args.node_rank}: give 0 .. {args.nnodes - 1} (--nnodes {args.nnodes})")
    if args.main_port is not None and not 0 <= args.main_port <= 65535:  # else a traceback from the launcher
        raise FinetuneError(f"--main-port {args.main_port}: give a TCP port, 1 .. 65535 (0 or none: a free one)")
    if args.node_rank > 0 and not args.main_address:
        raise FinetuneError(f"--node-rank {args.node_rank}: give --main-address, the address of the node of rank 0")
    if args.cpu:
        hide_gpus()  # before CUDA starts: this process and the ranks it launches see none
    from finetune.recipe import load_recipe

    # A bad recipe fails here, once (not on every rank), before the training stack is imported.
    recipe = load_recipe(args.recipe, args.overrides)
    check_reward_functions(recipe)  # here too, once, before any rank starts
    if (args.nproc > 1 or args.nnodes > 1) and not already_launched():
        check_before_launch(recipe, resume=args.resume, processes=args.nproc * args.nnodes)
        use_cpu = args.cpu or not _cuda_available()  # torch is imported only to ask: 1.3 s of a CPU launch
        if not use_cpu:
            import torch

            check_gpu_count(args.nproc, torch.cuda.device_count())
        train_args = [args.recipe, *args.overrides, *(["--resume"] if args.resume else [])]
        command = launch_command(
            train_args,
            nproc=args.nproc,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            main_address=args.main_address,
            main_port=args.main_port,
            use_cpu=use_cpu,
            verbose=args.verbose,
        )
        return run_launched(command, use_cpu=use_cpu, deepspeed=recipe.distributed.strategy == "deepspeed")

    from finetune.launched import is_first_rank
    from finetune.training.loop import train

    adapter_dir, _ = train(recipe, resume=args.resume)
    if is_first_rank():  # one line per run, not per process
        print(f"adapter: {adapter_dir}")
    _leave_process_group()
    return 0


def check_reward_functions(recipe: Any) -> None:
    """A GRPO recipe's reward functions load (files, functions, built-ins' arguments): a bad one fails in one line
    before the model and data load, not minutes later."""
    if recipe.train.objective == "grpo":
        from finetune.training.rewards import load_reward_functions

        load_reward_functions(recipe.train.reward_functions or [])


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _leave_process_group() -> None:
    """A launched rank ends its process group, then its process without the interpreter's teardown
    (`end_if_launched`: a rank that had finished and written the adapter died of SIGABRT now and then, in CI
    runs of the DDP test and on 2026-11-27 of the ZeRO-3 GRPO test). By now everything the run leaves is written,
    synced and closed."""
    import torch.distributed as dist

    from finetune.launched import end_if_launched

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    end_if_launched(0)


def run_validate(args: argparse.Namespace) -> int:
    from finetune.data.sources import check_local_source
    from finetune.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    check_reward_functions(recipe)
    for source in [*recipe.data.train, *(recipe.data.validation or [])]:
        check_local_source(source)
    if recipe.lora.init_from is not None:  # else only found by the run, once the base and the data are loaded
        from finetune.adapters.lora import read_adapter
        from finetune.errors import AdapterError

        try:
            read_adapter(recipe.lora.init_from)
        except AdapterError as exc:
            raise AdapterError(f"lora.init_from: {exc}") from None
    print(f"{args.recipe}: ok (adapter {recipe.output.adapter_dir}, {recipe.data.format} data, LoRA r={recipe.lora.r})")
    return 0
