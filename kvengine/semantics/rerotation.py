"""Moving cached keys to another position: the position fix-up of reuse beyond the prefix (issue 38).

A segment's KV computed on its own tokens alone, at positions ``0..n``, and the
same tokens' KV computed alone at ``d..d+n`` differ only in the rotary
embedding of the keys. Attention with rotary embeddings sees relative positions
only, so every hidden state of the segment, its values and its keys before
rotation are the same at either offset. Where the rotation angle is linear in
the position (``angle(p) = p * w`` per frequency ``w``), ``R(p + d) = R(d) R(p)``:
keys cached at ``0..n`` become the keys at ``d..d+n`` by one more rotation, by
the angles of position ``d`` alone.

What is stored: keys after rotation at the segment's own positions, as any
prefix record holds them. A segment record then serves a prompt that starts
with it unchanged, and any other position after a fix-up by ``d``; keys before
rotation would need a fix-up at every use, the prefix one included.

Per RoPE variant (``rope_type`` of a transformers config):

* ``default``, ``linear`` (positions scaled: still linear), ``llama3`` (per-frequency
  scaling of ``w``: still linear), ``yarn`` (interpolated ``w``, and an attention
  factor multiplying cos and sin: the fix-up rotates by the unscaled angles, so the
  factor is applied once, as in the original keys) and per-layer bases (Gemma's
  local and global layers, each layer with its own ``w``): **shiftable**, and proved
  against recomputation on real models (``tests/integrations/test_hf_rerotation.py``).
* ``dynamic``, ``longrope``: refused. Their frequencies depend on the length of the
  sequence that computed the keys, so a key is not a function of its position.
* Anything else: refused by name until proved.

This is approximate reuse only when the segment is placed behind other tokens:
the fix-up makes the segment's keys exact for the segment attending to itself,
not for what it would have attended to before it. Selective recompute closes
that gap; the fix-up alone is exact only for the segment's own positions.
"""

from __future__ import annotations

import torch

#: RoPE types whose angle is linear in the position: a cached key moves to another position exactly.
SHIFTABLE_ROPE = frozenset({"default", "linear", "llama3", "yarn"})
#: RoPE types refused, with the reason.
UNSHIFTABLE_ROPE = {
    "dynamic": "dynamic NTK rescales its frequencies from the sequence length, so a key is not a function of its "
    "position alone",
    "longrope": "LongRoPE switches its factors by sequence length, so a key is not a function of its position alone",
}


def rope_verdict(rope_type: str) -> str | None:
    """None where keys of ``rope_type`` move between positions exactly; else why not."""
    if rope_type in SHIFTABLE_ROPE:
        return None
    return UNSHIFTABLE_ROPE.get(rope_type, f"rope_type '{rope_type}' is not proved to move between positions")


def rotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``keys`` (``[..., tokens, head_dim]``) rotated by the angles whose cosines and sines are ``cos`` and
    ``sin`` (``[rotary_dim]``, or broadcastable to ``[..., tokens, rotary_dim]``), in the rotate-half
    layout (transformers' Llama family: a frequency's two coordinates are ``rotary_dim / 2`` apart). Only
    the first ``rotary_dim`` coordinates rotate (partial rotary); the rest pass through. A new tensor, in
    ``keys``' dtype, computed in float32."""
    dim = cos.shape[-1]
    if dim % 2 or dim > keys.shape[-1] or sin.shape[-1] != dim:
        raise ValueError(f"rotary dims {dim} (sin {sin.shape[-1]}) do not fit a head of {keys.shape[-1]}")
    k = keys.float()
    rot, rest = k[..., :dim], k[..., dim:]
    first, second = rot.chunk(2, dim=-1)
    turned = torch.cat((-second, first), dim=-1)
    out = torch.cat((rot * cos.float() + turned * sin.float(), rest), dim=-1)
    return out.to(keys.dtype)
