"""Recipe for qfserve-tiny, the small Llama that ships with qfserve.

Data generation, tokenizer training, a PyTorch training loop with checkpoint/resume,
export to mlx-lm's format, and evaluation through mlx-lm. Training-only: nothing in
``server``, ``engine`` or ``calibrations`` imports this package.
"""
