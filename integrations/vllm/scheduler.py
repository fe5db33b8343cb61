"""Scheduler half of the connector: answers vLLM's "how many tokens can you supply".

Per request, a small state machine (:class:`_Phase`):

* ``get_num_new_matched_tokens`` sends a lookup to the worker's engine over
  the channel and waits one round trip (at most ``lookup_wait_ms``) for the
  answer from the memory tier, or for "pending" when the engine must promote. The engine *reserves* the matched
  chunks (pins them, with a lease); asking again is idempotent and renews
  the lease. An answer still in flight (a promotion from disk or peers) is
  reported as ``None`` and vLLM asks again next step; that ask only looks
  for the answer, it never waits. The worker answers lookups of different
  requests at once, so the scheduler never waits on a disk. -> RESERVED
* ``update_state_after_alloc`` with tokens to load commits a load plan
  (request, token range, block ids) -> COMMITTED; with none, the
  reservation is released at once -> IDLE.
* ``build_connector_meta`` hands committed plans to the worker, which
  consumes the reservation by loading it -> IDLE; and asks the worker to
  store every chunk the step completes, prompt or generated (decode chunks:
  the next turn of a chat hits through the previous reply), and with tails
  (:mod:`kvengine.core.tails`) the partial chunk up to the last whole block,
  so hits end at a block.
* ``request_finished`` releases whatever is still reserved.

Prefill/decode disaggregation (:mod:`.handoff`): a producer's step that
completes a prompt also asks the worker to hand it off (``HandoffSpec``),
and ``request_finished`` returns the params a consumer needs; a consumer
checks a request's params once (a producer it trusts, its own namespace,
this prompt) and then looks the prompt up with its tail. A hybrid model's
prompt is handed off up to where that step began (the last position before
the prompt's end where vLLM materialized the recurrent state, see
:mod:`.state`), with that state.

So a request that was looked up but never scheduled (no blocks, aborted,
rejected) leaves nothing pinned: it is released when vLLM finishes it, or
reclaimed by the engine's lease if vLLM never speaks of it again.

Loads are synchronous (done before the step's forward; failures reported
per block) for single-group models, and asynchronous (done after the
forward; failures reported per request) when the model has several KV
cache groups, because vLLM only maps failed *blocks* back to requests for
single-group models.
"""

from __future__ import annotations

import array
import enum
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvengine.errors import InvalidRequestError
from kvengine.lookups import TIMED_OUT, LookupOutcome, LookupResult

from .channel import ChannelClosed
from .copy_specs import HandoffSpec, LoadSpec, SaveSpec
from .handoff import HandoffParams, Role
from .layout import GroupPlan
from .metadata import StepMetadata
from .options import DEFAULT_FETCH_TIMEOUT_S
from .ranks import RankedLookup
from .state import state_block

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from .metadata import ChannelAddress

logger = logging.getLogger("vllm.kvengine")

#: how long the scheduler waits for a lookup at most, beyond the longest read the worker's configuration
#: allows (a consumer's ``handoff.fetch_timeout``), before it gives the lookup up as a miss
LOOKUP_DEADLINE_MARGIN_S = 10.0


def token_bytes(tokens: Any) -> bytes:
    """Token ids as little-endian uint32 bytes (the engine's hashing input)."""
    packed = array.array("I", tokens)
    if sys.byteorder != "little":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


class _Phase(enum.Enum):
    IDLE = "idle"
    RESERVED = "reserved"  # the worker's engine holds a reservation for this request
    COMMITTED = "committed"  # vLLM allocated blocks for it; the load goes out this step


@dataclass(slots=True, eq=False)
class _RequestState:
    request: Request
    salt: str
    can_read: bool
    can_write: bool
    phase: _Phase = _Phase.IDLE
    pending_seq: int = 0  # lookup in flight (0: none)
    pending_len: int = 0
    pending_from: int = 0  # the in-flight lookup's computed tokens (vLLM's own prefix cache hit)
    pending_since: float = 0.0  # when the in-flight lookup was sent (time.monotonic)
    gave_up: bool = False  # a lookup past its deadline: the answer given then (``matched``) stands
    matched: int = 0
    plan: LoadSpec | None = None
    stored_until: int = 0
    #: a hit sampled for a shadow check: vLLM computes its first ``shadow_until`` tokens, the worker compares
    shadow_until: int = 0
    #: a consumer's handed-off prompt (:mod:`.handoff`): the producer that computed it (``host:port``),
    #: read from first, tail included
    handed_in_by: str | None = None
    #: ... and the tokens it stored, which the consumer looks up
    handed_in_tokens: int = 0
    #: a producer's handed-off prompt: the tokens whose KV it stored for a consumer (0: not yet)
    handed_out: int = 0


@dataclass(slots=True)
class SchedulerStats:
    """Counters of the scheduler half (its view of what vLLM was told)."""

    lookups: int = 0
    lookups_in_flight: int = 0  # answers not back within lookup_wait_ms
    lookup_errors: int = 0
    lookup_timeouts: int = 0  # lookups unanswered past the deadline: the request read nothing (a miss)
    hit_requests: int = 0
    offered_tokens: int = 0  # external tokens offered to vLLM (repeats included)
    committed_loads: int = 0
    committed_tokens: int = 0
    released: int = 0
    failed_loads: int = 0  # asynchronous loads the worker reported failed
    save_specs: int = 0
    shadow_checks: int = 0  # hits recomputed instead of loaded, to be compared by the worker
    skipped_requests: int = 0  # multimodal, LoRA or prompt-embedding requests
    by_reason: dict[str, int] = field(default_factory=dict)
    handoffs: int = 0  # producer: prompts handed off; consumer: handed-off prompts looked up
    refused_handoffs: dict[str, int] = field(default_factory=dict)  # consumer: params refused, by reason
    failed_handoffs: int = 0  # consumer, policy 'fail': handed-off prompts offered whole but not held whole


class SchedulerSide:
    def __init__(self, *, chunk_size: int, asynchronous: bool, lookup_wait_s: float,
                 state_group: GroupPlan | None = None,
                 role: Role = Role.BOTH, producers: frozenset[str] = frozenset(),
                 fail_short_handoffs: bool = False, tail_step: int = 0,
                 lookup_deadline_s: float = DEFAULT_FETCH_TIMEOUT_S + LOOKUP_DEADLINE_MARGIN_S) -> None:
        #: the unit of stores and hits: a block with tails (:mod:`kvengine.core.tails`), else a chunk
        self._step = tail_step or chunk_size
        self._async = asynchronous
        #: a hybrid model's recurrent-state group (see :mod:`.state`)
        self._state_group = state_group
        self._wait = lookup_wait_s
        #: a lookup the worker has not answered by then is given up: the request reads nothing and runs
        #: (the worker's reads have deadlines of their own, shorter; this one holds if one of them does not)
        self._deadline = lookup_deadline_s
        self._role = role
        #: a consumer's trusted producers (its ``peers``; :data:`.handoff.VIA_MOONCAKE` with a Mooncake tier)
        self._producers = producers
        #: a consumer under kv_load_failure_policy 'fail': a handed-off prompt it cannot load whole is offered
        #: whole anyway, so that its load fails and vLLM fails the request (else vLLM computes the rest)
        self._fail_short = fail_short_handoffs
        #: the worker's namespace and (a producer) handoff address, from its handshake
        self._namespace = ""
        self._handoff = ""
        self._client: RankedLookup | None = None
        self._manager: KVCacheManager | None = None
        self._states: dict[str, _RequestState] = {}
        self._committed: list[_RequestState] = []
        self.stats = SchedulerStats()

    @property
    def _has_state(self) -> bool:
        return self._state_group is not None

    # -- wiring ------------------------------------------------------------------
    def connect(self, addresses: Sequence[ChannelAddress]) -> None:
        """Connect to every tensor-parallel rank's engine (rank order)."""
        self._client = RankedLookup(addresses)
        self._namespace, self._handoff = addresses[0].namespace, addresses[0].handoff
        pids = [a.pid for a in addresses]
        logger.info("kvengine: scheduler half in pid %d, worker half (cache engine) in pid%s %s: %s", os.getpid(),
                    "s" if len(pids) > 1 else "", ", ".join(map(str, pids)),
                    "same process" if pids == [os.getpid()] else "separate processes")

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self._manager = manager

    # -- vLLM hooks --------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        # vLLM computes at least the last token; a handed-off hybrid prompt: from where its state was taken
        limit = st.handed_in_tokens if st.handed_in_by else request.num_tokens - 1
        if not st.can_read or self._client is None or limit < (1 if st.handed_in_by else self._step):
            return 0, False
        if st.gave_up:
            external = st.matched - num_computed_tokens
            return (external, self._async) if external > 0 else (0, False)
        try:
            wait = 0.0  # asked again: the answer is there or still pending, never waited for twice
            if st.pending_seq == 0 or (st.pending_len, st.pending_from) != (limit, num_computed_tokens):
                if st.pending_seq:
                    self._client.forget(st.pending_seq)
                st.pending_seq = self._client.submit(request.request_id, st.salt,
                                                     token_bytes(request.all_token_ids[:limit]), limit,
                                                     producer=st.handed_in_by, computed=num_computed_tokens)
                st.pending_len, st.pending_from = limit, num_computed_tokens
                st.pending_since = time.monotonic()
                self.stats.lookups += 1
                wait = self._wait
            answer = self._client.result(st.pending_seq, wait, until_pending=True)
        except ChannelClosed as exc:
            self._count_error(f"channel: {exc}")
            return 0, False
        if answer.outcome is LookupOutcome.PENDING:
            waited = time.monotonic() - st.pending_since
            if waited <= self._deadline:
                self.stats.lookups_in_flight += 1
                return None, False
            answer = self._give_up(st, waited)
        else:
            st.pending_seq = 0
        if answer.outcome is LookupOutcome.FAILED:
            self._count_error(answer.error)
        if answer.outcome is LookupOutcome.SHADOWED and not st.shadow_until:
            st.shadow_until = answer.tokens  # nothing reserved: vLLM computes it, the worker compares
            self.stats.shadow_checks += 1
        st.matched = answer.loadable
        if st.handed_in_by and self._fail_short and st.matched < limit:
            self.stats.failed_handoffs += 1
            logger.error("kvengine: handed-off prompt %s: %d of its %d tokens could be loaded from the producer "
                         "(gone, lease expired, or a record that did not verify); kv_load_failure_policy 'fail' "
                         "fails the request", request.request_id, st.matched, limit)
            st.matched = limit  # the load fails at the first missing token: vLLM applies its policy
        st.phase = _Phase.RESERVED if st.matched else _Phase.IDLE
        external = st.matched - num_computed_tokens
        if external <= 0:
            self._release(st)
            return 0, False
        self.stats.offered_tokens += external
        return external, self._async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self._states.get(request.request_id)
        if st is None:
            return
        if num_external_tokens <= 0:
            if st.phase is _Phase.RESERVED:  # offered but not taken (vLLM trimmed or skipped the hit)
                self._release(st)
            return
        if st.phase is not _Phase.RESERVED or num_external_tokens > st.matched:
            raise RuntimeError(f"kvengine: vLLM allocated {num_external_tokens} external tokens for "
                               f"{request.request_id} without a matching reservation ({st.phase.value}, "
                               f"{st.matched} tokens)")
        st.plan = LoadSpec(request_id=request.request_id, salt=st.salt, start=st.matched - num_external_tokens,
                           end=st.matched, block_ids=tuple(tuple(b) for b in blocks.get_block_ids()),
                           asynchronous=self._async)
        st.phase = _Phase.COMMITTED
        st.stored_until = max(st.stored_until, st.matched)
        self._committed.append(st)
        self.stats.hit_requests += 1
        self.stats.committed_loads += 1
        self.stats.committed_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepMetadata:
        meta = StepMetadata()
        if self._manager is not None:
            meta.null_block_id = self._manager.block_pool.null_block.block_id
        for st in self._committed:
            if st.phase is _Phase.COMMITTED and st.plan is not None:
                meta.loads.append(st.plan)
                st.plan = None
                st.phase = _Phase.IDLE  # the worker consumes the reservation by loading it
        self._committed.clear()
        scheduled = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        scheduled += list(zip(cached.req_ids, cached.num_computed_tokens))
        if self._role is Role.PRODUCER:
            self._hand_off(meta, scheduled, scheduler_output)
        for request_id, computed_before in scheduled:
            state = self._states.get(request_id)
            if state is None or not state.can_write:
                continue
            st = state
            computed = computed_before + scheduler_output.num_scheduled_tokens.get(request_id, 0)
            end = min(computed, self._storable(st.request)) // self._step * self._step
            if end <= st.stored_until or self._manager is None:
                continue
            block_ids = self._manager.get_block_ids(request_id)
            verify = (st.stored_until, min(end, st.shadow_until)) if st.shadow_until > st.stored_until else None
            meta.saves.append(SaveSpec(request_id=request_id, salt=st.salt,
                                       tokens=token_bytes(st.request.all_token_ids[:end]),
                                       block_ids=tuple(tuple(b) for b in block_ids),
                                       state_at_end=self._has_state and computed == end, verify=verify))
            st.stored_until = end
            self.stats.save_specs += 1
        return meta

    def _hand_off(self, meta: StepMetadata, scheduled: list[tuple[str, int]],
                  scheduler_output: SchedulerOutput) -> None:
        """A producer: of the ``scheduled`` requests (id, tokens computed before this step), those whose prompt
        this step completes hand it off (:mod:`.handoff`)."""
        for request_id, computed_before in scheduled:
            st = self._states.get(request_id)
            if st is None or not st.can_write or st.handed_out or self._manager is None:
                continue
            prompt = int(st.request.num_prompt_tokens)
            if computed_before + scheduler_output.num_scheduled_tokens.get(request_id, 0) < prompt or prompt < 2:
                continue
            # the consumer computes the last token; a hybrid model's, the tokens of this step (the recurrent
            # state exists where a prefill step began or ended, and this step ends at the prompt's end)
            handed = min(computed_before, prompt - 1) if self._has_state else prompt - 1
            if handed <= 0:
                continue  # the prompt in one step from its start: no state to hand off, the consumer computes it
            st.handed_out = handed
            block_ids = tuple(tuple(b) for b in self._manager.get_block_ids(request_id))
            meta.handoffs.append(HandoffSpec(request_id=request_id, salt=st.salt,
                                             tokens=token_bytes(st.request.all_token_ids[:handed]),
                                             block_ids=block_ids,
                                             state_block=self._state_after_step(request_id, handed, block_ids,
                                                                                scheduler_output)))
            self.stats.handoffs += 1

    def _state_after_step(self, request_id: str, boundary: int, block_ids: tuple[tuple[int, ...], ...],
                          scheduler_output: SchedulerOutput) -> int | None:
        """The block holding a hybrid model's recurrent state at ``boundary``, where this step began, once its
        forward ran (the worker reads it then; see :mod:`.state`). Inside a block the forward overwrites that
        state, so it is the copy vLLM made first and offers producers (``boundary_state_offloads``); at a
        block end, the block ending there (the forward writes past it). None: not a hybrid model, or no such
        copy (the step resumed a hit of vLLM's own prefix cache inside a block): the consumer then resumes at
        an earlier boundary with a stored state, or computes the prompt."""
        group = self._state_group
        if group is None:
            return None
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = block_state.boundary_state_offloads.get(request_id, ()) if block_state is not None else ()
        for group_id, block_id, tokens in offers:
            if group_id == group.group_id and tokens == boundary:
                return int(block_id)
        if boundary % group.block_size or self._manager is None:
            return None
        return state_block(group, block_ids, boundary, self._manager.block_pool.null_block.block_id)

    def update_connector_output(self, failed_recving: set[str]) -> None:
        """Requests whose asynchronous load failed are recomputed by vLLM; never offer them a hit again
        (a load that keeps failing would otherwise loop: fail, re-admit, look up, fail)."""
        for request_id in failed_recving:
            st = self._states.get(request_id)
            if st is not None:
                st.can_read = False
                self.stats.failed_loads += 1

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Release what the request holds; a producer returns the params of its handed-off prompt (the
        blocks are free at once: the worker copied the pages out in the step that computed them)."""
        st = self._states.pop(request.request_id, None)
        if st is None:
            return False, None
        if st.pending_seq and self._client is not None:
            self._abandon_lookup(st)
        else:
            self._release(st)
        if not st.handed_out:
            return False, None
        return False, HandoffParams(self._handoff, st.handed_out, self._namespace).to_transfer_params()

    def shutdown(self) -> None:
        if self._client is not None:
            self._client.close()
        logger.info("kvengine: scheduler stats %s", self.stats)

    # -- helpers ----------------------------------------------------------------------------
    def _storable(self, request: Request) -> int:
        """How far the request's chunks may be stored: through its generated tokens (so the next turn of
        a chat hits through this reply) as far as their ids are known here; a hybrid model's prompt only.

        A token's KV is computed when it is fed, and a fed token's id is in ``all_token_ids`` (with async
        scheduling the token being sampled is not yet: its chunk is stored a step later). A hybrid model
        stores no recurrent state at boundaries reached while decoding (vLLM's 'align' mode places them
        by prefill steps; not validated), and chunks without a state at their end are never a hit there.
        """
        if self._has_state:
            return int(request.num_prompt_tokens)
        return len(request.all_token_ids)

    def _state(self, request: Request) -> _RequestState:
        st = self._states.get(request.request_id)
        if st is None:
            reason = _ineligible(request)
            if reason:
                self.stats.skipped_requests += 1
                self.stats.by_reason[reason] = self.stats.by_reason.get(reason, 0) + 1
            st = _RequestState(request=request, salt=request.cache_salt or "", can_read=not reason and
                               not _skips_connector_reads(request),
                               can_write=not reason and self._role is not Role.CONSUMER)
            if self._role is Role.CONSUMER and st.can_read and (params := self._handed_in(request)) is not None:
                st.handed_in_by, st.handed_in_tokens = params.producer, params.tokens
            self._states[request.request_id] = st
        return st

    def _handed_in(self, request: Request) -> HandoffParams | None:
        """The params of a consumer's request, where it may load from the producer they name (None: not
        handed off, or refused: counted by reason and logged once, and served as a plain lookup)."""
        try:
            params = HandoffParams.from_transfer_params(request.kv_transfer_params)
        except InvalidRequestError as exc:
            self._refuse_handoff("malformed", str(exc))
            return None
        if params is None:
            return None
        if params.producer not in self._producers:
            self._refuse_handoff("untrusted_producer", f"producer {params.producer} is not one of this "
                                 f"instance's kvengine.peers, nor its Mooncake tier ({sorted(self._producers)})")
            return None
        if params.namespace != self._namespace:
            self._refuse_handoff("namespace_mismatch", f"producer {params.producer} computed KV in namespace "
                                 f"{params.namespace}, this instance reads {self._namespace}: another model, "
                                 "weights, dtype, KV layout or tensor-parallel split; its KV is not loaded")
            return None
        # a hybrid model's producer stops where its last prefill step began (see _hand_off)
        if not (0 < params.tokens < request.num_tokens if self._has_state else params.tokens == request.num_tokens - 1):
            self._refuse_handoff("token_count", f"the producer stored {params.tokens} tokens of a prompt of "
                                 f"{request.num_tokens}: not this request's prompt")
            return None
        self.stats.handoffs += 1
        return params

    def _refuse_handoff(self, reason: str, why: str) -> None:
        refused = self.stats.refused_handoffs
        refused[reason] = refused.get(reason, 0) + 1
        if refused[reason] == 1:
            logger.error("kvengine: handed-off prompt refused (%s); computed here instead", why)
        return None

    def _release(self, st: _RequestState) -> None:
        if st.phase is _Phase.IDLE:
            return
        st.phase = _Phase.IDLE
        st.plan = None
        st.matched = 0
        self.stats.released += 1
        if self._client is not None and not self._client.closed:
            try:
                self._client.release(st.request.request_id)
            except ChannelClosed:
                pass  # the worker is gone; so is its engine

    def _abandon_lookup(self, st: _RequestState) -> None:
        """Drop the in-flight lookup's answer and release what it may reserve, after it (the worker runs one
        request's calls in order)."""
        assert self._client is not None
        self._client.forget(st.pending_seq)
        st.pending_seq = 0
        st.phase = _Phase.RESERVED
        self._release(st)

    def _give_up(self, st: _RequestState, waited: float) -> LookupResult:
        """Stop waiting for the in-flight lookup: what it reserves, once done, is released, and the answer
        given now stands when vLLM asks again (a new lookup could wait as long again)."""
        self._abandon_lookup(st)
        st.gave_up = True
        self.stats.lookup_timeouts += 1
        logger.error("kvengine: the worker has not answered the lookup of request %s in %.1f s; it reads nothing "
                     "from the cache (a miss)", st.request.request_id, waited)
        return TIMED_OUT

    def _count_error(self, error: str) -> None:
        self.stats.lookup_errors += 1
        if self.stats.lookup_errors == 1:
            logger.warning("kvengine: lookup failed (%s); served as a miss", error)


def _skips_connector_reads(request: Request) -> bool:
    """Whether vLLM wants no cached KV read for this request from a connector: vLLM 0.34 renamed the flag
    (``skip_reading_external_kv``, also set for prompt-logprob requests, whose hits it bounds), 0.32 and
    0.33 have ``skip_reading_prefix_cache`` (``scripts/vllm_interfaces.py`` checks both)."""
    return bool(request.skip_reading_external_kv if hasattr(request, "skip_reading_external_kv")
                else request.skip_reading_prefix_cache)


def _ineligible(request: Request) -> str:
    """Why a request's KV cannot be keyed by its token ids alone ('' if it can)."""
    if request.prompt_token_ids is None or getattr(request, "prompt_embeds", None) is not None:
        return "prompt_embeds"
    if request.mm_features:
        return "multimodal"
    if request.lora_request is not None:
        return "lora"
    if getattr(request, "pooling_params", None) is not None:
        return "pooling"
    return ""
