"""Layers built on the permutation ops: the expert MLP (expert_mlp) and its FP8 path (fp8_mlp)."""
