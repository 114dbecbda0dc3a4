"""A GPT-style model defined in code, for `gradient-cache plan` (nothing is downloaded):

    gradient-cache plan --model examples.plan_gpt:gpt_1b --tokens 16384 --micro-batches 4

The planner calls ``gpt_1b()`` under ``torch.device("meta")``: the 1.3B parameters get
shapes but no memory. Run it from the repository root so that ``examples`` imports.
"""

from __future__ import annotations

from gradient_cache.demo.models import GPTConfig, TinyGPT


def gpt_1b() -> TinyGPT:
    """GPT-2 XL's shape: 24 blocks of width 2048, 16 heads, a 50,304-token vocabulary."""
    config = GPTConfig(vocab_size=50304, seq_len=2048, d_model=2048, n_layers=24, n_heads=16)
    return TinyGPT(config)
