"""Parallelism-free building blocks of the Motif-3 model: RoPE, GDLA attention (+ kernels), mHC, MoE, MLP, norms."""
