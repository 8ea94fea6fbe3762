"""The training run: recipe in, adapter directory out, on one process or many.

Modules, one job each: `run` builds a run's state (`start_run` -> `TrainingRun`); `loop` steps it
(`train`); `loss` is the next-token loss; `evaluate` the held-out loss; `checkpoint` saves and restores
a step exactly; `interrupt` turns signals into a checkpoint and a clean stop; `progress` and `tracking`
report each step (console, metrics.jsonl, TensorBoard and other trackers); `sharding` (DDP and the
interface), `fsdp` and `deepspeed` share the model between processes; `launch` starts several; `finish`
writes the adapter and its manifest.

Example:
    from finetune.training.loop import train
    adapter_dir, metrics = train("recipes/quickstart.yaml", ["train.max_steps=20"])
"""
