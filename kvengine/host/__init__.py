"""The host cache service: one memory tier per machine that outlives the engines using it.

``kvengine host`` (:class:`~kvengine.host.service.HostService`) holds the
memory tier's arena in shared memory; engines configured with
``memory.service`` attach to it (:class:`~kvengine.host.client.ServiceMemory`)
in place of an arena of their own. Control (pins, two-phase stores) crosses a
Unix socket; chunk bytes are copied straight between the engine's tensors and
the shared arena. See ``docs/host.md``.
"""
