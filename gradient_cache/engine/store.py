"""The gradient store: the one owner of what is cached, bucket by bucket (its writers and
readers: docs/ARCHITECTURE.md's ownership table)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping

import torch

from ..codecs import Payload
from .bucket import Bucket, BucketState
from .figures import LayerFigures, StepFigures
from .records import CachedParam

Param = torch.nn.Parameter
BucketPayloads = list[tuple[Param, Payload]]


class GradientStore:
    """Each cached parameter's payload, in the bucket it was offloaded with."""

    def __init__(self) -> None:
        self._buckets: list[Bucket] = []  # launched, in arrival order
        self._where: dict[Param, Bucket] = {}

    def put(self, payloads: dict[Param, Payload]) -> None:
        """Keep ``payloads`` as a new bucket. A parameter cached already (accumulation: its
        old payload was added into the new one) leaves its old bucket."""
        bucket = Bucket(payloads)
        for param in payloads:
            if (previous := self._where.get(param)) is not None:
                del previous.payloads[param]
            self._where[param] = bucket
        self._buckets = [b for b in self._buckets if b.payloads]
        self._buckets.append(bucket)

    def landed(self) -> None:
        """Every bucket's host copies are complete (the backend's drain returned)."""
        for bucket in self._buckets:
            bucket.state = BucketState.CACHED

    def payload(self, param: Param) -> Payload | None:
        bucket = self._where.get(param)
        return None if bucket is None else bucket.payloads[param]

    def bucket_state(self, param: Param) -> BucketState | None:
        """The state of the bucket holding ``param``'s payload (None: not cached)."""
        bucket = self._where.get(param)
        return None if bucket is None else bucket.state

    def __getitem__(self, param: Param) -> Payload:
        return self._where[param].payloads[param]

    def __contains__(self, param: object) -> bool:
        return param in self._where

    def __len__(self) -> int:
        return len(self._where)

    def __iter__(self) -> Iterator[Param]:
        """The cached parameters, in the order they were first cached this step."""
        return iter(list(self._where))

    def parts(self, params: Collection[Param]) -> list[BucketPayloads]:
        """The payloads of those of ``params`` cached here, bucket by bucket in arrival order;
        a bucket not yet landed raises: host payloads are read only after the drain."""
        parts = []
        for bucket in self._buckets:
            part = [(p, payload) for p, payload in bucket.payloads.items() if p in params]
            if not part:
                continue
            if bucket.state is not BucketState.CACHED:
                raise RuntimeError("gradient-cache internal error: a restore before the drain")
            parts.append(part)
        return parts

    def remove(self, params: Collection[Param]) -> None:
        """Forget the payloads of ``params`` (restored, or stepped); empty buckets go."""
        for param in params:
            del self._where.pop(param).payloads[param]
        self._buckets = [b for b in self._buckets if b.payloads]

    def buckets(self) -> list[BucketPayloads]:
        """Every bucket's (parameter, payload) pairs, in arrival order (checkpoints)."""
        return [list(b.payloads.items()) for b in self._buckets]

    def figures(self, records: Mapping[Param, CachedParam], params: Iterable[Param]) -> StepFigures:
        """The figures of the payloads of ``params``, cached here (sizes only: no data is read)."""
        figures = StepFigures()
        for param in params:
            payload, record = self[param], records[param]
            figures.layers[record.name] = LayerFigures(
                numel=record.route.numel,
                dense_bytes=record.route.numel * param.element_size(),
                stored_bytes=payload.nbytes,
                kept=payload.kept,
                compressed=record.route.compressed,
                codec=record.route.codec.name,
            )
        return figures

    def tensors(self) -> Iterator[torch.Tensor]:
        """The host payloads' tensors (memory accounting)."""
        for bucket in self._buckets:
            for payload in bucket.payloads.values():
                yield from payload.tensors()
