"""What the scheduler half tells the worker half each step, and the channel handshake.

Both cross processes pickled by vLLM (scheduler output broadcast, handshake
collection), so they are plain frozen dataclasses of ints, strings and bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from .layout import BlockIds


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadSpec:
    """Copy the reserved chunks of a request into its blocks, tokens ``[start, end)``.

    ``start`` is where vLLM's own (local) cache hit ends; blocks before it
    are vLLM's and are not written. ``asynchronous`` loads run after the
    step's forward and are reported through ``get_finished``.
    """

    request_id: str
    salt: str
    start: int
    end: int
    block_ids: BlockIds
    asynchronous: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveSpec:
    """Store the full chunks of ``tokens`` (little-endian uint32) from the request's blocks.

    Chunks the engine already holds are skipped without being read.
    """

    request_id: str
    salt: str
    tokens: bytes
    block_ids: BlockIds
    #: the step's computed prefix ends exactly at ``tokens``' end, so a hybrid model's recurrent
    #: state at that boundary is in its state group (see :mod:`.state`)
    state_at_end: bool = False
    #: a shadow check: compare the stored chunks of tokens ``[lo, hi)`` (computed by this step instead
    #: of loaded) with the pages vLLM just computed
    verify: tuple[int, int] | None = None


@dataclass(slots=True)
class StepMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    null_block_id: int = 0


@dataclass(frozen=True, slots=True)
class ChannelAddress(KVConnectorHandshakeMetadata):
    """Where the worker's lookup service listens (see :mod:`.channel`)."""

    path: str
    authkey: bytes
    pid: int
