"""Order-0 entropy bound of a payload, the yardstick for lossless codecs.

Definition used: the payload is cut into the same segments the lossless
codecs use (runs of tensors of one item size); each segment is split into
its ``itemsize`` byte planes (byte ``j`` of every element), and each plane
is charged its order-0 (memoryless) Shannon entropy ``n * H(plane)`` bits.
The bound is ``raw bits / charged bits``: the best ratio of a coder that
models each byte plane as i.i.d. symbols, which is what shuffle + entropy
coding approaches. It ignores correlations between planes and neighbours,
so a codec can in principle beat it, though float KV rarely lets it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvengine.chunks.record import TensorDescriptor

from .lossless import segments


def plane_entropy_bits(data: bytes | memoryview, itemsize: int) -> float:
    """Sum over the ``itemsize`` byte planes of ``data`` of ``n * H0(plane)`` bits."""
    planes = np.frombuffer(data, np.uint8).reshape(-1, itemsize)
    n = planes.shape[0]
    total = 0.0
    for j in range(itemsize):
        counts = np.bincount(planes[:, j], minlength=256)
        p = counts[counts > 0] / n
        total += float(-(p * np.log2(p)).sum()) * n
    return total


def entropy_bound(raw: bytes | memoryview, tensors: Sequence[TensorDescriptor]) -> float:
    """Order-0 per-byte-plane compression ratio bound of ``raw`` (see module doc)."""
    view = memoryview(raw).cast("B")
    bits = sum(plane_entropy_bits(view[a:b], size) for a, b, size in segments(tensors))
    return 8 * len(view) / bits if bits else float("inf")
