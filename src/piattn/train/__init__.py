"""The training engine: the loop behind `piattn train`, checkpoints, the optimiser, DDP.

Submodules: task (the `Task` interface the loop trains, and the shared evaluation loop), loop (the
Trainer), checkpoint (atomic save, exact resume), optim (AdamW groups, warmup-cosine schedule, clipping),
distributed (torchrun / DDP), metrics (metrics.jsonl). What is learned lives in `piattn.tasks`; the
command-line front-ends in `piattn.commands`.
"""
