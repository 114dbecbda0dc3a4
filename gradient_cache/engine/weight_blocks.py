"""Which modules are a model's blocks, and which parameters travel with each.

With ``offload_parameters=True`` the weights come to the device a block at a time (the one
running, the next arriving). The blocks are the children of one container of repeated
layers: the one ``parameter_blocks`` names (a dotted module name, ``"transformer.h"``), or
else the ``nn.ModuleList`` / ``nn.Sequential`` whose children hold the most parameter
bytes (a transformer's layers). A parameter used by one block only travels with it; every
other one (embeddings, the final norm and head, a weight tied across blocks or between a
block and the rest) is in the *rest*, on the device from the model's forward to the end of
its backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Param = torch.nn.Parameter
CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential)


@dataclass(frozen=True)
class WeightUnits:
    """The model's parameters cut into units that travel together: ``blocks`` (in
    forward order) and their parameters (``block_params``), and the ``rest``."""

    blocks: list[torch.nn.Module]
    block_params: list[list[Param]]
    rest: list[Param]


def find_blocks(model: torch.nn.Module, *, name: str | None = None) -> list[torch.nn.Module]:
    """The blocks of ``model``: the children of the container ``name`` names, or of the
    `CONTAINERS` one whose children hold the most parameter bytes (at least two of them
    holding parameters). Raises ValueError, naming how to name them, where there is none."""
    if name is not None:
        try:
            container = model.get_submodule(name)
        except AttributeError as error:
            raise ValueError(
                f"parameter_blocks={name!r} names no module of {type(model).__name__} "
                f"({error}). Give the dotted name of the module list that holds its blocks, "
                "as model.named_modules() lists it (e.g. 'transformer.h' for GPT-2)."
            ) from None
        blocks = [child for child in container.children() if _bytes(child)]
        if len(blocks) < 2:
            raise ValueError(
                f"parameter_blocks={name!r} names a {type(container).__name__} with "
                f"{len(blocks)} child module(s) holding parameters; the weights stream a "
                "block at a time, so it must hold the model's repeated blocks (two or more)."
            )
        return blocks
    best: list[torch.nn.Module] = []
    for module in model.modules():
        if isinstance(module, CONTAINERS):
            blocks = [child for child in module.children() if _bytes(child)]
            if len(blocks) >= 2 and sum(map(_bytes, blocks)) > sum(map(_bytes, best)):
                best = blocks
    if not best:
        raise ValueError(
            f"offload_parameters=True found no blocks in {type(model).__name__}: the weights "
            "come to the device a block at a time, and the blocks are the children of an "
            "nn.ModuleList or nn.Sequential (a transformer's layers), of which it has none "
            "with two or more holding parameters. Hold the repeated layers in an "
            "nn.ModuleList, or name their container: parameter_blocks='encoder.layers'."
        )
    return best


def weight_units(model: torch.nn.Module, *, name: str | None = None) -> WeightUnits:
    """``model``'s parameters cut into its blocks' and the rest (see the module docstring)."""
    blocks = find_blocks(model, name=name)
    users: dict[Param, set[int]] = {}
    for index, block in enumerate(blocks):
        for param in block.parameters():
            users.setdefault(param, set()).add(index)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    outside = {
        id(p) for module in _outside(model, blocks) for p in module.parameters(recurse=False)
    }
    block_params: list[list[Param]] = [[] for _ in blocks]
    rest = []
    for param in model.parameters():
        owners = users.get(param, set())
        if id(param) in in_blocks and len(owners) == 1 and id(param) not in outside:
            block_params[next(iter(owners))].append(param)
        else:
            rest.append(param)
    return WeightUnits(blocks, block_params, rest)


def _outside(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules of ``model`` that are not inside one of ``blocks``."""
    inside = {id(m) for block in blocks for m in block.modules()}
    return [module for module in model.modules() if id(module) not in inside]


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())
