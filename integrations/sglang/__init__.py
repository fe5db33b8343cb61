"""SGLang integration: kvengine as a HiCache storage backend (L3).

The backend class is ``kvengine.integrations.sglang.backend.KVEngineHiCacheStorage``
(it imports SGLang; this package itself does not). See ``docs/sglang.md``.

* :mod:`.pages` – a host pool's page geometry as a kvengine chunk layout.
* :mod:`.options` – extra-config settings and the namespace of the pages.
* :mod:`.backend` – the ``HiCacheStorage`` subclass.
"""

from __future__ import annotations

MODULE_PATH = "kvengine.integrations.sglang.backend"
CLASS_NAME = "KVEngineHiCacheStorage"


def extra_config(**own: object) -> dict[str, object]:
    """The ``--hicache-storage-backend-extra-config`` mapping that loads this backend, plus ``own`` keys."""
    return {"backend_name": "kvengine", "module_path": MODULE_PATH, "class_name": CLASS_NAME,
            "interface_v1": 1, **own}


__all__ = ["CLASS_NAME", "MODULE_PATH", "extra_config"]
