"""Whether a worker may serve KV on the attention backends vLLM picked: validated in-tree, proven on this
machine, or the named risk.

The CPU backends (:data:`~.layout.ATTENTION_BACKENDS`) are validated end to
end by the test suite. The GPU backends (:data:`~.layout.PROVABLE_BACKENDS`)
cannot be run here, so a worker that meets one serves only when

* a verification record written by ``kvengine verify vllm`` on this machine
  matches the running :class:`~kvengine.trust.verification.Platform` in every
  field (accelerator and driver, torch, vLLM, backend, KV dtype, layout id,
  block size, tensor-parallel size), the model fingerprint and the kvengine
  version, and its digest and seal verify; or
* the connector option ``verification.serve_unverified_backend_risking_wrong_outputs``
  is true: logged at ERROR level at every start, because a backend whose pages
  differ from what kvengine assumes answers worse without failing.

Anything else refuses to start, naming the backend, why the record (if any)
was refused, and the command that writes one.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Info

from kvengine.chunks.keys import Namespace
from kvengine.errors import UnsupportedModelError
from kvengine.trust.secrets import read_secret_file
from kvengine.trust.verification import Platform, Refusal, check_in, kvengine_version

from .layout import PagedLayout
from .options import VerificationOptions

logger = logging.getLogger("vllm.kvengine")


class Acceptance(enum.Enum):
    """Why the worker serves on its backends (published as a label of ``kvengine_vllm_platform_info``)."""

    VALIDATED = "validated in-tree"
    RECORD = "verification record of this platform"
    RISK_ACCEPTED = "unverified, risk accepted by the operator"


def vllm_platform(layout: PagedLayout, namespace: Namespace, device_type: str) -> Platform:
    """The :class:`Platform` this worker runs on: the host's accelerator, vLLM's version, the backends its
    layers declared, the KV dtype, the layout id (backends, layout, page split, vLLM's per-platform choices)
    and the smallest block size."""
    import vllm

    kv_dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in layout.chunk.tensors})
    return Platform.on_host(
        device_type, engine="vllm", engine_version=str(vllm.__version__),
        attention_backend="+".join(sorted(layout.backends)), kv_dtype="+".join(kv_dtypes),
        kv_layout_id=namespace.layout_id, block_size=min(g.block_size for g in layout.groups),
        tensor_parallel_size=namespace.world_size)


def accept_backends(layout: PagedLayout, platform: Platform, namespace: Namespace,
                    options: VerificationOptions) -> Acceptance:
    """How this worker's backends are accepted (module docstring).

    :raises UnsupportedModelError: a backend that needs proof, no record that proves it, and no opt-in.
    :raises ConfigError: ``verification.secret_file`` cannot be read.
    """
    unproven = sorted(layout.unproven_backends)
    if not unproven:
        return Acceptance.VALIDATED
    secret = read_secret_file(options.secret_file, "verification.secret_file")
    path, check = check_in(options.records, platform, namespace.model_fingerprint, kvengine_version(), secret)
    if check.record is not None:
        logger.info("kvengine: attention backend %s accepted by the verification record %s (verified %s)",
                    "+".join(unproven), path, check.record.date)
        return Acceptance.RECORD
    found = "no record" if check.refusal is Refusal.MISSING else \
        f"record {path} refused: {check.refusal.value if check.refusal else ''} ({check.detail})"
    if options.serve_unverified_backend_risking_wrong_outputs:
        logger.error("kvengine: SERVING ON UNVERIFIED ATTENTION BACKEND %s (%s in %s): "
                     "verification.serve_unverified_backend_risking_wrong_outputs is set, so KV pages are served "
                     "without proof that they are exact on this platform; wrong pages do not crash, the model "
                     "answers worse. Run `kvengine verify vllm --model %s` here to prove it instead.",
                     "+".join(unproven), found, options.records, namespace.model)
        return Acceptance.RISK_ACCEPTED
    raise UnsupportedModelError(
        f"kvengine vLLM connector: attention backend {'+'.join(unproven)} has not been validated in-tree and no "
        f"verification record proves it on this platform ({found}; looked in {options.records}). Run "
        f"`kvengine verify vllm --model {namespace.model} --records {options.records}` on this machine with the same "
        "settings, or set kv_connector_extra_config['verification']"
        "['serve_unverified_backend_risking_wrong_outputs'] = true to serve unproven KV at your own risk")



def publish_platform(registry: CollectorRegistry, platform: Platform, namespace: Namespace,
                     acceptance: Acceptance) -> None:
    """``kvengine_vllm_platform_info``: the platform, model fingerprint and acceptance as labels (for operators,
    and for ``kvengine verify vllm``, which writes its record from them)."""
    labels = {k: "" if v is None else ",".join(v) if isinstance(v, (list, tuple)) else str(v)
              for k, v in platform.as_dict().items()}
    Info("kvengine_vllm_platform", "The platform this worker serves on, its model and why its backends are "
         "accepted", registry=registry).info({**labels, "model_fingerprint": namespace.model_fingerprint,
                                              "acceptance": acceptance.name.lower()})


def platform_from_labels(labels: Mapping[str, str]) -> tuple[Platform, str]:
    """The :class:`Platform` and model fingerprint :func:`publish_platform` exposed (scraped labels).

    :raises ValueError: a label missing or malformed.
    """
    fields: dict[str, Any] = {k: labels.get(k, "") for k in Platform.__dataclass_fields__}
    for key in ("driver_version", "cuda_version", "attention_backend"):
        fields[key] = fields[key] or None
    fields["isa_flags"] = tuple(f for f in fields["isa_flags"].split(",") if f)
    fields["block_size"] = int(fields["block_size"])
    fields["tensor_parallel_size"] = int(fields["tensor_parallel_size"])
    fingerprint = labels.get("model_fingerprint")
    if not fingerprint:
        raise ValueError("kvengine_vllm_platform_info has no model_fingerprint")
    return Platform(**fields), fingerprint
