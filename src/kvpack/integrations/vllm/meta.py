"""What the scheduler half tells the worker half each step, and what comes back.

Plain dataclasses of ints, bytes and tuples: vLLM pickles the scheduler's metadata to its
worker processes and sends the worker's metadata back with the model output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from .prefix import LoadSpec, SaveSpec


@dataclass(frozen=True)
class SendSpec:
    """Producer: a finished request whose blocks are held until its consumer fetched them."""

    req_id: str
    tokens: tuple[int, ...]  # the prompt
    block_ids: tuple[int, ...]
    deadline_unix: float


@dataclass(frozen=True)
class RecvSpec:
    """Consumer: fetch the prompt's prefix (all but its last token) from the producer."""

    req_id: str
    tokens: tuple[int, ...]  # the prompt
    position: int  # rows to receive: the prompt minus its last token
    block_ids: tuple[int, ...]
    params: dict[str, Any]  # the producer's kv_transfer_params
    local: int = 0  # rows vLLM already holds (block aligned): only [local, position) is written


@dataclass
class KvpackMetadata(KVConnectorMetadata):
    ids: bytes  # the 8 Id32 of the scheduler's identity (IdentityIds.encode())
    block_size: int
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    sends: list[SendSpec] = field(default_factory=list)
    recvs: list[RecvSpec] = field(default_factory=list)


@dataclass
class KvpackWorkerMeta(KVConnectorWorkerMetadata):
    saved: set[str] = field(default_factory=set)  # requests whose saves finished (or failed)
    resave: set[str] = field(default_factory=set)  # requests whose load failed: save after recompute

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KvpackWorkerMeta):
            self.saved |= other.saved
            self.resave |= other.resave
        return self

    def is_empty(self) -> bool:
        return not (self.saved or self.resave)
