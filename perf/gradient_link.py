"""The gradients' bytes over the link per parameter, by micro-batch count, on the emulated device.

    python -m perf.gradient_link [--model small] [--micro-batches 1 2 3 4] [--device cuda]

TinyGPT ``--model`` with the weights and the optimizer state on the host (AdamW, lossless
gradients, clipped at 1.0), set up from the host on the emulated accelerator
(`gradient_cache.testing`, a CPU emulation with its own device type, so the accelerator
backend and its copies run; ``--device cuda`` on a GPU), with fp32 compute and with
``compute_dtype=torch.bfloat16``.
Counted at the backend over the second step (`Copies`): the payload bytes copied out in
backward (device to host), those brought back in backward (an encode reading the cached
part: accumulation, or a clipped step's norm), and those the step's restore brings back,
each divided by the parameter count. The weights' and the state's own copies are not
counted here (`perf.weights_bytes` has them). Bytes, not time: the emulated device has no
link to time.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

import gradient_cache
from gradient_cache.demo.models import GPT_SIZES, TinyGPT
from gradient_cache.testing import emulated_device
from perf.harness import cpu_model


@dataclass
class Copies:
    """Payload bytes the accelerator backend copies while `counting`: ``out`` into its
    host slots (`Backend.store`), ``back`` to the device for an encode, ``restored`` by a
    restore."""

    out: int = 0
    back: int = 0
    restored: int = 0

    @contextlib.contextmanager
    def counting(self, manager: Any) -> Iterator[None]:
        """Count ``manager``'s gradient copies inside the block (its backend's methods
        wrapped on the instance, put back after): outside a restore, only an encode reading
        the cached part brings payload bytes to the device."""
        backend = manager.engine.backend
        store, to_device, start_restore = backend.store, backend.to_device, backend.start_restore
        restoring = False

        def stored(encoded: list, grads: list) -> Any:
            # What the copies move: an earlier micro-batch's part on the host already stays.
            tensors = [t for each in encoded for t in each.payload.tensors()]
            self.out += sum(t.nbytes for t in tensors if t.device.type != "cpu")
            return store(encoded, grads)

        def brought(tensor: torch.Tensor) -> torch.Tensor:
            self.back += 0 if restoring else tensor.nbytes
            return to_device(tensor)

        def restore(items: list, **options: Any) -> Any:
            nonlocal restoring
            self.restored += sum(payload.nbytes for _, payload in items)
            restoring = True
            try:
                return start_restore(items, **options)
            finally:
                restoring = False

        backend.store, backend.to_device, backend.start_restore = stored, brought, restore
        try:
            yield
        finally:
            del backend.store, backend.to_device, backend.start_restore


def measure(
    model_name: str,
    micro_batches: int,
    compute_dtype: torch.dtype | None,
    *,
    device: torch.device,
) -> Copies:
    """The second step's gradient copies (see the module docstring)."""
    torch.manual_seed(0)
    config = GPT_SIZES[model_name]
    model = TinyGPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    manager = gradient_cache.create_gradient_cache(
        model,
        device=device,
        compression_ratio=1,
        offload_optimizer_state=True,
        offload_parameters=True,
        compute_dtype=compute_dtype,
    )
    tokens = torch.randint(config.vocab_size, (4, config.seq_len), device=device)
    copies = Copies()
    for step in range(2):
        counted = copies.counting(manager) if step else contextlib.nullcontext()
        with counted:
            for _ in range(micro_batches):
                _, loss = model(tokens, tokens)
                (loss / micro_batches).backward()
            manager.step(optimizer, max_grad_norm=1.0)
        optimizer.zero_grad()
    manager.remove_hooks()
    return copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", choices=sorted(GPT_SIZES))
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument(
        "--device", default="emulated", help="'emulated' (the default), or an accelerator: cuda"
    )
    args = parser.parse_args()
    device = emulated_device() if args.device == "emulated" else torch.device(args.device)
    count = sum(p.numel() for p in TinyGPT(GPT_SIZES[args.model]).parameters())
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {cpu_model()}")
    print(f"# torch {torch.__version__}, TinyGPT {args.model!r} ({count} parameters), {device}")
    print(
        "| compute | micro-batches | out in backward | back in backward | back at the restore "
        "| total | per micro-batch |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for micro_batches in args.micro_batches:
        for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
            c = measure(args.model, micro_batches, dtype, device=device)
            total = c.out + c.back + c.restored
            print(
                f"| {name} | {micro_batches} | {c.out / count:.3f} | {c.back / count:.3f} "
                f"| {c.restored / count:.3f} | {total / count:.3f} "
                f"| {total / count / micro_batches:.3f} |"
            )


if __name__ == "__main__":
    main()
