"""Lightning's ModelParallelStrategy (FSDP2) on 2 CPU processes, with and without the cache.

    python tests/lightning_fsdp_run.py OUT_DIR

Run by tests/test_lightning.py. Lightning's launcher starts the second process by running
this script again; rank 0 writes ``results.json`` to OUT_DIR: weight differences against
the plain run (same seed and data, gradient clipping on), and of a run resumed from a
checkpoint against the uninterrupted one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from gradient_cache.integrations.lightning import GradientCacheCallback


class Sharded(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 5)
        )

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.net[0], mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 16, generator=generator), torch.randn(64, 5, generator=generator)
    )
    return torch.utils.data.DataLoader(data, batch_size=8)


def fit(callbacks: list, *, max_epochs: int = 1, ckpt_path: str | None = None, **trainer):
    model = Sharded()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_epochs=max_epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=0.05,
        **{"enable_checkpointing": False, **trainer},
        callbacks=callbacks,
    )
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return trainer, [p.full_tensor() for p in model.parameters()]


def difference(left: list[torch.Tensor], right: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(left, right, strict=True))


def main(out_dir: Path) -> None:
    _, plain = fit([])
    lossless = GradientCacheCallback(compression_ratio=1)
    _, cached = fit([lossless])
    on_host = GradientCacheCallback(
        compression_ratio=1, offload_optimizer_state=True, offload_parameters=True
    )
    _, weights_on_host = fit([on_host])

    options = dict(compression_ratio=100, codec="topk", min_compress_numel=64)
    saver = ModelCheckpoint(dirpath=out_dir / "ckpt", save_top_k=-1, every_n_epochs=1)
    _, uninterrupted = fit(
        [GradientCacheCallback(**options), saver], max_epochs=2, enable_checkpointing=True
    )
    first_epoch = str(sorted((out_dir / "ckpt").glob("epoch=0*"))[0])
    trainer, resumed = fit([GradientCacheCallback(**options)], max_epochs=2, ckpt_path=first_epoch)

    # The weights and the state on the host: a resume from Lightning's distributed checkpoint.
    on_host_options = dict(
        compression_ratio=1, offload_optimizer_state=True, offload_parameters=True
    )
    saver = ModelCheckpoint(dirpath=out_dir / "ckpt_on_host", save_top_k=-1, every_n_epochs=1)
    _, on_host_uninterrupted = fit(
        [GradientCacheCallback(**on_host_options), saver], max_epochs=2, enable_checkpointing=True
    )
    first_epoch = str(sorted((out_dir / "ckpt_on_host").glob("epoch=0*"))[0])
    _, on_host_resumed = fit(
        [GradientCacheCallback(**on_host_options)], max_epochs=2, ckpt_path=first_epoch
    )
    if trainer.global_rank == 0:
        results = {
            "lossless": difference(plain, cached),
            "weights on host": difference(plain, weights_on_host),
            "resumed": difference(uninterrupted, resumed),
            "weights on host resumed": difference(on_host_uninterrupted, on_host_resumed),
            "summary_numel": lossless.last_summary["layers"]["net.2.weight"]["numel"],
        }
        (out_dir / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
