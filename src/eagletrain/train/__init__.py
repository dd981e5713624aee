"""Stage 3, train: the drafter built, one TTT step, the loop with held-out evaluation and
exact-resume checkpoints, under torchrun (DDP or FSDP)."""
