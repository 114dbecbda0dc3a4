"""Which modules are a model's blocks (how they are found: docs/options.md,
``parameter_blocks``), and which parameters travel with each. A parameter used by one block
only travels with it; every other one (embeddings, the final norm and head, a weight tied
across units) is in the *rest*, on the device from the model's forward to its backward's end.
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
    """The blocks of ``model``: the children of the container ``name`` names, or else of the
    `CONTAINERS` one holding the most bytes and of its peers (`_peer`) outside it, in module
    order (forward order for an encoder-decoder). Raises ValueError naming the fix."""
    if name is not None:
        return _named_blocks(model, name)
    candidates = [m for m in model.modules() if isinstance(m, CONTAINERS) and len(_holding(m)) >= 2]
    if not candidates:
        raise ValueError(
            f"offload_parameters=True found no blocks in {type(model).__name__}: the weights "
            "come to the device a block at a time, and the blocks are the children of an "
            "nn.ModuleList or nn.Sequential (a transformer's layers), of which it has none "
            "with two or more holding parameters. Hold the repeated layers in an "
            "nn.ModuleList, or name their container: parameter_blocks='encoder.layers'. "
            "(Under @gradient_cache.optimize the model is the outermost module called: a "
            "loop calling model.forward(x), or a submodule on its own, makes that submodule "
            "the model; call model(x), or gradient_cache.manager_of(model) first.)"
            + _one_module_repeated(model)
        )
    # A container most of whose bytes are one child container of blocks wraps that list
    # (nn.Sequential(embed, nn.Sequential(*blocks), head)): its children are not blocks.
    lists = {id(c) for c in candidates}
    unwrapped = [c for c in candidates if not _wraps(c, lists)] or candidates
    largest = max(unwrapped, key=lambda c: sum(map(_bytes, _holding(c))))
    chosen = [largest]
    for container in candidates:
        if _peer(container, largest) and not any(
            _nested(container, c) or _nested(c, container) for c in chosen
        ):
            chosen.append(container)
    order = {id(m): i for i, m in enumerate(model.modules())}
    chosen.sort(key=lambda c: order[id(c)])
    return [child for container in chosen for child in _holding(container)]


def _named_blocks(model: torch.nn.Module, name: str) -> list[torch.nn.Module]:
    """The children of the container ``name`` names, or a ValueError naming the fix."""
    try:
        container = model.get_submodule(name)
    except AttributeError as error:
        raise ValueError(
            f"parameter_blocks={name!r} names no module of {type(model).__name__} "
            f"({error}). Give the dotted name of the module list that holds its blocks, "
            "as model.named_modules() lists it (e.g. 'transformer.h' for GPT-2)."
        ) from None
    if not isinstance(container, CONTAINERS):
        lists = [
            f"{name}.{inner}"
            for inner, module in container.named_modules()
            if inner and isinstance(module, CONTAINERS) and len(_holding(module)) >= 2
        ]
        hint = f" (in it: {', '.join(map(repr, lists[:3]))})" if lists else ""
        raise ValueError(
            f"parameter_blocks={name!r} names a {type(container).__name__}, not the "
            "nn.ModuleList or nn.Sequential of its blocks: the blocks are that list's "
            "children, and a module's whole would come to the device as one block. Name "
            f"the list{hint}, e.g. 'transformer.h' for GPT-2, not 'transformer'."
        )
    blocks = _holding(container)
    if len(blocks) < 2:
        raise ValueError(
            f"parameter_blocks={name!r} names a {type(container).__name__} with "
            f"{len(blocks)} child module(s) holding parameters; the weights stream a "
            "block at a time, so it must hold the model's repeated blocks (two or more)."
            + _one_module_repeated(container, name)
        )
    return blocks


def _one_module_repeated(model: torch.nn.Module, prefix: str = "") -> str:
    """What to do where a list holds one module several times (ALBERT), else nothing."""
    for name, module in model.named_modules(prefix=prefix):
        if isinstance(module, CONTAINERS) and len({id(m) for m in module}) < len(module) > 1:
            where = repr(name) if name else type(module).__name__
            return (
                f" Here {where} holds one module {len(module)} times: one set of weights at "
                "every depth (as ALBERT's), which the device holds whole, so there is no "
                "block to stream. Create the cache without offload_parameters "
                "(offload_optimizer_state=True still puts the optimizer state on the host)."
            )
    return ""


def _holding(container: torch.nn.Module) -> list[torch.nn.Module]:
    """``container``'s children that hold parameters."""
    return [child for child in container.children() if _bytes(child)]


def _wraps(container: torch.nn.Module, lists: set[int]) -> bool:
    """Whether a child of ``container`` in ``lists`` (of blocks) holds over half its bytes."""
    children = _holding(container)
    total = sum(map(_bytes, children))
    return any(id(child) in lists and 2 * _bytes(child) > total for child in children)


def _peer(container: torch.nn.Module, largest: torch.nn.Module) -> bool:
    """Whether ``container`` holds layers repeated as ``largest``'s are (an encoder's beside
    a decoder's). Not a short list of small shared modules (adapters called in every
    layer): run several times a forward, it would hold every block until backward ends."""
    children, theirs = _holding(container), _holding(largest)
    return (
        len({type(child) for child in children}) == 1
        and 2 * len(children) >= len(theirs)
        and 4 * sum(map(_bytes, children)) >= sum(map(_bytes, theirs))
    )


def _nested(inner: torch.nn.Module, outer: torch.nn.Module) -> bool:
    """Whether ``inner`` is ``outer`` or inside it."""
    return any(module is inner for module in outer.modules())


def weight_units(model: torch.nn.Module, *, name: str | None = None) -> WeightUnits:
    """``model``'s parameters cut into its blocks' and the rest."""
    blocks = find_blocks(model, name=name)
    users: dict[Param, set[int]] = {}
    for index, block in enumerate(blocks):
        for param in block.parameters():
            users.setdefault(param, set()).add(index)
    inside = {id(m) for block in blocks for m in block.modules()}
    outside = [module for module in model.modules() if id(module) not in inside]
    owned_outside = {id(p) for module in outside for p in module.parameters(recurse=False)}
    block_params: list[list[Param]] = [[] for _ in blocks]
    rest = []
    for param in model.parameters():
        owners = users.get(param, set())
        if len(owners) == 1 and id(param) not in owned_outside:
            block_params[next(iter(owners))].append(param)
        else:
            rest.append(param)
    return WeightUnits(blocks, block_params, rest)


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())
