"""GDLA attention (docs/model-spec.md §2.4, §3, §5): the module (`gdla`), RoPE / YaRN (`rope`), the attention
kernels behind `[kernels] attention` and the per-forward metadata they share (`backends`), the visibility
masks and QK-clip's max-logit side pass (`masks`, with its Triton kernel `max_logits_kernels`), and the
flash-attn-4 kernel (`fa4`)."""
