"""A Metaflow flow whose training step runs under @gradient_cache.optimize.

tests/test_metaflow.py runs it locally and compares the trained weights with the same
training run without the cache (`train` below, imported by the test).
"""

from __future__ import annotations

import torch
from metaflow import FlowSpec, step
from torch import nn

import gradient_cache

STEPS = 5


def make_model_and_data() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    data = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(STEPS)]
    return model, data


def train(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for inputs, targets in data:
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()


class CachedTrainingFlow(FlowSpec):
    @step
    def start(self) -> None:
        self.next(self.train)

    @step
    @gradient_cache.optimize(compression_ratio=1)
    def train(self) -> None:
        model, data = make_model_and_data()
        train(model, data)
        self.weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        self.next(self.end)

    @step
    def end(self) -> None:
        pass


if __name__ == "__main__":
    CachedTrainingFlow()
