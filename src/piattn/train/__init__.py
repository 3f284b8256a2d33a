"""The training engine: the loop behind `piattn train`, checkpoints, the optimiser, DDP.

Submodules: task (the `Task` interface the loop trains, and the shared evaluation loop), loop (the
Trainer), checkpoint (atomic save, exact resume), optim (AdamW groups, warmup-cosine schedule, clipping),
distributed (torchrun / DDP), metrics (metrics.jsonl, metrics.png), statistics (paired differences and
t-intervals). What is learned lives in `piattn.tasks`; the
command-line front-ends in `piattn.commands`.
"""
