"""The vLLM KV connector: ``kv_connector="KVEngineConnector"``.

>>> LLM(model=..., kv_transfer_config={
...     "kv_connector": "KVEngineConnector",
...     "kv_connector_module_path": "kvengine.integrations.vllm.connector",
...     "kv_role": "kv_both",  # or kv_producer / kv_consumer (prefill/decode disaggregation, .handoff)
...     "kv_load_failure_policy": "recompute",
...     "kv_connector_extra_config": {"kvengine": {"chunk_size": 256, "disk": {"path": "/var/cache/kv"}}},
... })

vLLM builds one instance per role: the scheduler half
(:class:`~.scheduler.SchedulerSide`) in the engine-core process and the
worker half (:class:`~.worker.WorkerSide`) in the worker process, which owns
the :class:`~kvengine.KVEngine`. They talk over :mod:`.channel`. Every
refusal happens in the constructor or in ``register_kv_caches``, before the
first request, as :class:`~kvengine.errors.UnsupportedModelError` or
:class:`~kvengine.errors.ConfigError`.

Where refusals surface: vLLM 0.32 calls no connector hook with the engine
configuration in the calling (main) process before it starts the engine
core; it only imports this module there (``VllmConfig.__post_init__`` asks
whether the class supports the hybrid allocator). So :func:`check_config`,
every refusal decidable from the configuration alone, runs first in both
halves' constructors, and also in the main process wherever vLLM gives a
hook: ``requires_piecewise_for_cudagraph`` (options only; vLLM calls it when
CUDA graphs are on) and ``build_prom_metrics`` (stat loggers). With
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the exception reaches the caller as it
is; in the default topology vLLM replaces it by "Engine core initialization
failed" and the reason is only in the engine core's log above it: call
:func:`preflight` first to get it in your process (docs/vllm.md).

Stats: ``get_kv_connector_stats`` / ``build_kv_connector_stats`` /
``build_prom_metrics`` put kvengine's counters into vLLM's own stats path
(:mod:`.stats`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvengine.addresses import split_host_port
from kvengine.errors import ConfigError, UnsupportedModelError

from .handoff import Role, handoff_sources
from .layout import AUTO_CHUNK_TARGET, GroupKind, GroupPlan, plan_groups, resolve_chunking, shares_one_copy
from .metadata import ChannelAddress, StepMetadata
from .options import ConnectorOptions
from .scheduler import LOOKUP_DEADLINE_MARGIN_S, SchedulerSide
from .stats import KVEnginePromMetrics, KVEngineStats, SchedulerStatsSource, WorkerStatsSource
from .worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.kvengine")


#: Why sleep mode is refused (vLLM 0.33+ asks ``supports_sleep_mode``; 0.32 has no hook, check_vllm_config refuses).
SLEEP_MODE_REFUSAL = (
    "kvengine vLLM connector: enable_sleep_mode is not supported: sleep discards the KV cache and, at level 2, "
    "the weights; weights loaded after wake-up need not be those kvengine fingerprinted at start-up, and it "
    "would keep serving KV computed by the old ones")


def check_vllm_config(vllm_config: VllmConfig) -> None:
    """Refuse settings under which reuse is not implemented or not exact."""
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size != 1 or getattr(pc, "data_parallel_size", 1) != 1:
        raise UnsupportedModelError(
            f"kvengine vLLM connector: pipeline_parallel_size={pc.pipeline_parallel_size}, data_parallel_size="
            f"{getattr(pc, 'data_parallel_size', 1)}: only tensor parallelism is supported")
    if getattr(pc, "decode_context_parallel_size", 1) != 1 or getattr(pc, "prefill_context_parallel_size", 1) != 1:
        raise UnsupportedModelError("kvengine vLLM connector: context parallelism is not supported")
    if vllm_config.speculative_config is not None:
        raise UnsupportedModelError("kvengine vLLM connector: speculative decoding is not supported")
    if vllm_config.model_config.is_encoder_decoder:
        raise UnsupportedModelError("kvengine vLLM connector: encoder-decoder models are not supported")
    if vllm_config.model_config.enable_sleep_mode:
        raise UnsupportedModelError(SLEEP_MODE_REFUSAL)
    kt = vllm_config.kv_transfer_config
    if kt.kv_role not in {r.value for r in Role}:
        raise ConfigError(f"kvengine vLLM connector: kv_role must be one of {[r.value for r in Role]} (a local "
                          f"cache; prefill or decode instance of a disaggregated deployment), got {kt.kv_role!r}")
    if kt.kv_load_failure_policy != "recompute" and not (kt.kv_load_failure_policy == "fail" and
                                                         kt.kv_role == Role.CONSUMER.value):
        raise ConfigError(
            "kvengine vLLM connector: set kv_transfer_config kv_load_failure_policy='recompute': a cache fault "
            f"must make vLLM recompute, not fail the request (got {kt.kv_load_failure_policy!r}; 'fail' is for "
            "a kv_consumer, whose handed-off prompts then fail when they cannot be loaded)")
    if vllm_config.cache_config.cache_dtype not in ("auto", None):
        raise UnsupportedModelError(f"kvengine vLLM connector: kv_cache_dtype={vllm_config.cache_config.cache_dtype!r} "
                                    "(quantized KV) has not been validated; use 'auto'")


def check_tensor_parallel(plans: tuple[GroupPlan, ...], options: ConnectorOptions, world_size: int) -> None:
    """Refuse what has not been validated with several tensor-parallel ranks (one engine per rank, the hit
    is what every rank holds): MLA next to other groups or at more than two ranks (rank 0's one copy of the
    latent is loaded by every rank, :mod:`.replica`; the latent is proven identical on every rank at two
    only), shadow checks (sampled per rank)."""
    if world_size == 1:
        return
    prefix = f"kvengine vLLM connector: tensor_parallel_size={world_size} with"
    mla = [p.group_id for p in plans if p.kind is GroupKind.MLA]
    if mla and len(mla) < len(plans):
        raise UnsupportedModelError(f"{prefix} MLA latent pages (KV cache groups {mla}) next to other KV cache "
                                    "groups has not been validated")
    if mla and world_size > 2:
        raise UnsupportedModelError(
            f"{prefix} MLA latent pages has not been validated: rank 0 stores the one copy of the replicated latent "
            "and every rank loads it, which is exact only where every rank computes the same latent bytes; that is "
            "proven at tensor_parallel_size=2, while with more ranks the all-reduce may add partial sums in "
            "another order on each rank")
    if options.engine.shadow.enabled:
        raise UnsupportedModelError(f"kvengine vLLM connector: shadow checks with tensor_parallel_size={world_size} "
                                    "are not supported (each rank would sample its own hits)")


def check_roles(plans: tuple[GroupPlan, ...], options: ConnectorOptions, role: Role, world_size: int = 1) -> None:
    """Refuse what a prefill/decode handoff (:mod:`.handoff`) cannot serve exactly, or lacks to run."""
    mooncake = options.engine.mooncake.master is not None
    if role is Role.PRODUCER and options.handoff.listen is None and not mooncake:
        raise ConfigError("kvengine vLLM connector: kv_role 'kv_producer' needs kv_connector_extra_config "
                          "handoff.listen: 'host:port' where decode instances fetch the prompts' KV (or a "
                          "kvengine.mooncake tier the decode instances share)")
    if role is Role.CONSUMER and not options.engine.peers.peers and not mooncake:
        raise ConfigError("kvengine vLLM connector: kv_role 'kv_consumer' needs kvengine.peers.peers: the prefill "
                          "instances' handoff addresses (handoff.advertise), the only producers it loads from (or "
                          "a kvengine.mooncake tier the prefill instances share)")
    if role is not Role.BOTH and world_size > 1:
        # rank r of a consumer reads from rank r of its producer: its server at the producer's port + r
        if shares_one_copy(plans, world_size):
            raise UnsupportedModelError(f"kvengine vLLM connector: kv_role {role.value!r} with MLA at "
                                        f"tensor_parallel_size={world_size} is not supported (rank 0 holds the "
                                        "one copy of the latents and shares it with the other ranks)")
        listen = options.handoff.listen
        if role is Role.PRODUCER and listen is not None and split_host_port(listen)[1] == 0:
            raise ConfigError(f"kvengine vLLM connector: handoff.listen {listen}: at tensor_parallel_size="
                              f"{world_size} give a port: rank r serves on that port + r, where consumers' rank r "
                              "reads")
    state = [p.group_id for p in plans if p.kind is GroupKind.STATE]
    if role is not Role.BOTH and state and world_size > 1:
        raise UnsupportedModelError(
            f"kvengine vLLM connector: kv_role {role.value!r} with recurrent-state KV cache groups {state} at "
            f"tensor_parallel_size={world_size} is not validated (a hybrid model's handoff is, at one rank)")


def check_config(vllm_config: VllmConfig) -> ConnectorOptions:
    """Every refusal decidable from the configuration alone, before any engine exists: the settings
    (:func:`check_vllm_config`: parallelism, speculative decoding, roles, kv_cache_dtype)
    and the connector options (unknown keys, ill-typed values, a chunk_size that is no positive integer,
    unknown or lossy codecs). Returns the parsed options (their chunk size is resolved later, against the
    block sizes vLLM picks at start-up)."""
    check_vllm_config(vllm_config)
    return ConnectorOptions.from_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)


def preflight(config: Any) -> VllmConfig:
    """Refuse, in the calling process, a configuration the connector would refuse at start-up.

    ``config``: vLLM ``EngineArgs`` (its engine configuration is built, as ``LLM``/``LLMEngine`` would)
    or a ``VllmConfig``. vLLM 0.32's default (multiprocess) topology replaces a refusal raised in the
    engine core by a generic "Engine core initialization failed"; this raises kvengine's own
    :class:`~kvengine.errors.ConfigError` or :class:`~kvengine.errors.UnsupportedModelError` instead.
    Returns the ``VllmConfig``.
    """
    vllm_config = config.create_engine_config() if hasattr(config, "create_engine_config") else config
    if vllm_config.kv_transfer_config is None or vllm_config.kv_transfer_config.kv_connector != \
            KVEngineConnector.__name__:
        raise ConfigError(f"kvengine vLLM connector: kv_transfer_config does not select {KVEngineConnector.__name__}")
    check_config(vllm_config)
    return vllm_config


class KVEngineConnector(KVConnectorBase_V1, SupportsHMA):
    """kvengine as a vLLM v1 KV connector (scheduler and worker halves, see module docs)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        options = check_config(vllm_config)
        plans = plan_groups(kv_cache_config)
        check_tensor_parallel(plans, options, vllm_config.parallel_config.tensor_parallel_size)
        kv_role = Role(vllm_config.kv_transfer_config.kv_role)
        check_roles(plans, options, kv_role, vllm_config.parallel_config.tensor_parallel_size)
        self._plans = plans
        # hits to the last whole block (a cache's; a handoff moves the prompt less its last token instead)
        chunking = resolve_chunking(plans, options.chunk_size, world_size=vllm_config.parallel_config
                                    .tensor_parallel_size, tails=kv_role is Role.BOTH)
        options = options.with_chunk_size(chunking.chunk_size)
        if role == KVConnectorRole.SCHEDULER:  # once per engine, not per half
            logger.info("kvengine: chunk_size %d tokens (%s; block sizes of the KV cache groups: %s)",
                        chunking.chunk_size, "explicit" if chunking.explicit else
                        f"auto: least common multiple of the block sizes, at least {AUTO_CHUNK_TARGET}",
                        [p.block_size for p in plans])
        # vLLM maps failed blocks back to requests only for single-group models;
        # with several groups, loads are asynchronous so failures go per request.
        asynchronous = len(plans) > 1
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        #: the block size the engine core resolved from the KV cache groups (see _keep_block_size)
        self._block_size = int(vllm_config.cache_config.block_size)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(chunk_size=chunking.chunk_size, tail_step=chunking.tail_step,
                                            asynchronous=asynchronous,
                                            lookup_wait_s=options.lookup_wait_s,
                                            lookup_deadline_s=options.handoff.fetch_timeout + LOOKUP_DEADLINE_MARGIN_S,
                                            state_group=chunking.state_group,
                                            role=kv_role,
                                            producers=handoff_sources(options.engine),
                                            fail_short_handoffs=vllm_config.kv_transfer_config.kv_load_failure_policy
                                            == "fail")
        else:
            self._worker = WorkerSide(vllm_config=vllm_config, kv_cache_config=kv_cache_config, options=options,
                                      chunking=chunking, asynchronous=asynchronous, role=kv_role)
        self._worker_stats: WorkerStatsSource | None = None
        self._scheduler_stats = SchedulerStatsSource(self._scheduler.stats) if self._scheduler is not None else None
        logger.info("kvengine: %s half ready (groups %s, %s loads)", role.name.lower(),
                    [p.kind.value for p in plans], "async" if asynchronous else "sync")

    # ============================== configuration hooks (main process) ==============================
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """vLLM calls this in the main process while it builds the configuration, when CUDA graphs are
        on: the options are checked there, so their refusals reach the caller. Loads and saves run
        layer by layer, outside any captured graph."""
        ConnectorOptions.from_extra_config(extra_config)
        return True

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33+ asks in the main process, with ``enable_sleep_mode``: refused (:data:`SLEEP_MODE_REFUSAL`).
        vLLM's default says yes: only the device registrations would follow, not the weights' identity."""
        return False

    # ============================== stats (vLLM's stat loggers and /metrics) ==============================
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVEngineStats(data) if data is not None else KVEngineStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        check_config(vllm_config)
        return KVEnginePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._scheduler_stats is not None:
            return self._scheduler_stats.take()
        if self._worker_stats is None:
            if self._worker is None or self._worker.engine is None:
                return None
            self._worker_stats = WorkerStatsSource(self._worker.engine.metrics.registry)
            self._worker_stats.dirty = True
        return self._worker_stats.take()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    # ============================== worker half ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker.handshake() if self._worker is not None else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, StepMetadata)
        self._worker.load(meta)
        if meta.loads and self._worker_stats is not None:
            self._worker_stats.dirty = True

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, StepMetadata)
        self._worker.save_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, StepMetadata)
        self._worker.save(meta)
        if (meta.saves or meta.loads) and self._worker_stats is not None:
            self._worker_stats.dirty = True

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        finished, failed = self._worker.take_finished()
        if finished and self._worker_stats is not None:
            self._worker_stats.dirty = True
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    # ============================== scheduler half ==============================
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        if self._scheduler is None:
            return
        addresses = [metadata[rank] for rank in sorted(metadata) if isinstance(metadata[rank], ChannelAddress)]
        world = self._vllm_config.parallel_config.tensor_parallel_size
        expected = 1 if shares_one_copy(self._plans, world) else world  # MLA at TP > 1: rank 0 alone answers
        if len(addresses) != expected:
            raise UnsupportedModelError(f"kvengine vLLM connector: expected {expected} worker channel(s) for "
                                        f"tensor_parallel_size={world}, got {len(addresses)}")
        self._scheduler.connect(addresses)

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        self._keep_block_size()
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def _keep_block_size(self) -> None:
        """Undo a reset of the scheduler's block size (a vLLM 0.32 defect of its multiprocess engine).

        The engine-core process sets ``cache_config.block_size`` from the KV cache groups (for a
        hybrid model, the attention block enlarged to hold a recurrent-state page: 384 tokens on
        an AVX-512 bf16 CPU), builds the scheduler (and this connector), and then re-runs
        ``VllmConfig.__post_init__``, whose CPU platform hook puts the block size back to its
        default (128). The scheduler reads that field when it splits prefills in
        ``mamba_cache_mode='align'``, so it then ends them on 128-token multiples where no state
        block ends: no recurrent state is materialized where it can be cached, by vLLM's own prefix
        cache or by kvengine. The in-process engine never re-runs it and keeps the resolved value,
        which is what this restores, before each lookup (the scheduler asks before it splits).
        """
        cache_config = self._vllm_config.cache_config
        if cache_config.block_size != self._block_size:
            logger.warning("kvengine: vLLM reset the scheduler's block size to %d after start-up; restoring the "
                           "block size of its KV cache groups (%d) so prefills end on block boundaries",
                           cache_config.block_size, self._block_size)
            cache_config.block_size = self._block_size

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None and connector_output.failed_recving:
            self._scheduler.update_connector_output(set(connector_output.failed_recving))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    # ============================== both ==============================
    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()

