"""The gradient store (engine/store.py): the one owner of what is cached."""

from __future__ import annotations

import pytest
import torch


def test_the_store_refuses_to_hand_out_a_bucket_still_landing() -> None:
    """Host payloads are complete only after the drain: a restore before it is a bug."""
    from gradient_cache.codecs import DensePayload
    from gradient_cache.engine.store import GradientStore

    param = torch.nn.Parameter(torch.zeros(4))
    store = GradientStore()
    store.put({param: DensePayload(torch.ones(4))})
    with pytest.raises(RuntimeError, match="a restore before the drain"):
        store.parts({param})
    store.landed()
    assert [[p for p, _ in part] for part in store.parts({param})] == [[param]]
