"""Where the rotated block codecs' range ends: a gradient entry's magnitude against each codec.

    python perf/rotation_range.py

q4, q3, q2 and sign rotate each block of 128 entries (`codecs/rotation.py`) before coding;
the rotation sums a block's entries (scaled by 1 / sqrt(128)), so near fp32's largest
value the sums overflow and the decoded gradient holds inf or NaN. int8 codes the entries
as they are. One Linear(256, 128) weight, its gradient set to Gaussian entries of a quarter
of the magnitude shown with one entry at it, coded and decoded once through the cache
(no warm-up, every tensor compressed): "ok" where the restored gradient is finite.
"""

from __future__ import annotations

import torch

import gradient_cache
from gradient_cache.codecs.registry import BLOCK_CODECS

CODECS = ("int8", *BLOCK_CODECS)
MAGNITUDES = (1e36, 1e37, 2e37, 3e37, 1e38)


def restored_is_finite(codec: str, magnitude: float) -> bool:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 128, bias=False)
    hook_manager = gradient_cache.create_gradient_cache(
        model, codec=codec, warmup_steps=0, min_compress_numel=1
    )
    gradient = torch.randn(128, 256) / 4
    gradient[0, 0] = 1.0
    (model.weight * gradient * magnitude).sum().backward()
    hook_manager.compress_and_free_gradients()
    hook_manager.apply_gradients()
    finite = bool(torch.isfinite(model.weight.grad).all())
    hook_manager.remove_hooks()
    return finite


def main() -> None:
    print("| codec | " + " | ".join(f"{m:.0e}" for m in MAGNITUDES) + " |")
    print("|---" * (len(MAGNITUDES) + 1) + "|")
    for codec in CODECS:
        cells = ["ok" if restored_is_finite(codec, m) else "inf/NaN" for m in MAGNITUDES]
        print(f"| {codec} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
