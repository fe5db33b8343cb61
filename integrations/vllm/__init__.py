"""vLLM integration: a v1 KV connector backed by a kvengine cache (memory + disk tiers).

Turn it on with ``kv_transfer_config`` (see docs/vllm.md)::

    {"kv_connector": "KVEngineConnector",
     "kv_connector_module_path": "kvengine.integrations.vllm.connector",
     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"kvengine": {"chunk_size": 256, "disk": {"path": "/var/cache/kv"}}}}

Modules (only ``connector``, ``scheduler``, ``worker`` and ``metadata`` import vLLM):

* :mod:`.connector` - the ``KVConnectorBase_V1`` / ``SupportsHMA`` class, delegating to
* :mod:`.scheduler` - the scheduler half (lookups, reservations, load and store plans), and
* :mod:`.worker` - the worker half (owns the engine, copies pages), which answer over
* :mod:`.channel` - the scheduler-to-worker lookup channel;
* :mod:`.layout` - KV cache groups and registered caches -> chunk layout, refusals;
* :mod:`.paging` - page copies between vLLM's blocks and chunks (:mod:`.copy_specs`: what to copy);
* :mod:`.identity` - the model's namespace; :mod:`.options` - connector settings;
* :mod:`.tiny_models` - tiny random models for tests, the example and the benchmark.
"""
