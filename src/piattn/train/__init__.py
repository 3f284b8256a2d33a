"""Training and evaluation: the loop behind `piattn train`, checkpoints, the optimiser, tasks, DDP.

Submodules: optim (AdamW groups, warmup-cosine schedule, clipping), checkpoint (atomic save, exact resume),
loop (the Trainer), tasks (what is learned: `lm`), distributed (torchrun / DDP), metrics (metrics.jsonl),
cli (`piattn train`), evaluate (`piattn eval`).
"""
