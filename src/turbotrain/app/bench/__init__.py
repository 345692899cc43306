"""``turbotrain bench``: contenders side by side, the precision matrix and the optimization ablation,
each row in its own process on the same model, data, seed and global batch (docs/bench.md)."""
