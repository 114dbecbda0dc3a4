"""The bucket assembler (engine/bucket.py): gradients gathered to capacity, in arrival order."""

from __future__ import annotations

import torch

from gradient_cache.engine.bucket import BucketAssembler


def test_bucket_assembler_fills_to_capacity_in_arrival_order() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 20, 5, 40)]
    assembler = BucketAssembler(capacity_bytes=100)
    full = [assembler.add(p, torch.zeros(p.numel()), torch.float32) for p in params]
    assert full[0] is None and full[1] is not None  # 40 B, then 120 B >= 100 B
    assert [p for p, _ in full[1]] == params[:2]
    assert full[2] is None and [p for p, _ in full[3]] == params[2:]
    assert assembler.flush() is None


def test_a_second_gradient_for_a_waiting_parameter_is_added_to_it() -> None:
    param = torch.nn.Parameter(torch.zeros(3))
    assembler = BucketAssembler(capacity_bytes=100)
    first, second = torch.tensor([0.1, 0.2, 0.3]), torch.tensor([1e-8, 5.0, -0.3])
    expected = first + second  # plain PyTorch's accumulation
    assert assembler.add(param, first, torch.float32) is None
    assert assembler.add(param, second, torch.float32) is None
    [(held, grad)] = assembler.flush()
    assert held is param and torch.equal(grad, expected)
