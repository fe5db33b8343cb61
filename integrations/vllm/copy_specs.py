"""The worker's copy instructions for one request: load reserved chunks into blocks, save blocks as chunks.

Plain frozen dataclasses of ints, strings and bytes (pickled across vLLM's processes inside
:class:`~.metadata.StepMetadata`), free of vLLM so that the page pipeline and the device self-check run
where vLLM is not installed (the GPU run).
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True, kw_only=True)
class HandoffSpec:
    """A producer computed a prompt (:mod:`.handoff`): store the partial last chunk of ``tokens`` (the
    prompt less its last token; a hybrid model's: the prompt up to where this step began) from the request's
    blocks, and hold its chunks for a consumer."""

    request_id: str
    salt: str
    tokens: bytes
    block_ids: BlockIds
    #: a hybrid model: the block holding the recurrent state at ``tokens``' end once this step's forward ran
    #: (see :mod:`.state`; None: none)
    state_block: int | None = None
