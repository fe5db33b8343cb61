"""What the scheduler half tells the worker half each step (:class:`StepMetadata`: the step's
:mod:`.copy_specs`), and the channel handshake: vLLM's metadata classes, subclassed.

Both cross processes pickled by vLLM (scheduler output broadcast, handshake
collection), so they are plain frozen dataclasses of ints, strings and bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from .copy_specs import HandoffSpec, LoadSpec, SaveSpec


@dataclass(slots=True)
class StepMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    handoffs: list[HandoffSpec] = field(default_factory=list)
    null_block_id: int = 0


@dataclass(frozen=True, slots=True)
class ChannelAddress(KVConnectorHandshakeMetadata):
    """Where the worker's lookup service listens (see :mod:`.channel`), and what its scheduler tells
    consumers of the prompts it hands off (:mod:`.handoff`)."""

    path: str
    authkey: bytes
    pid: int
    #: hex digest of the worker's (unsalted) namespace
    namespace: str = ""
    #: a producer's handoff server, as consumers dial it ("" where none runs)
    handoff: str = ""
