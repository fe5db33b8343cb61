"""The serving benchmark's hit-rate ceiling (what any cache could have supplied), on a hand-built run."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

from bench_serving import hit_ceiling


def test_the_ceiling_counts_whole_units_of_what_each_users_previous_turn_computed():
    reqs = [{"user": u, "turn": t, "prompt_tokens": n, "generated_tokens": 16}
            for u, t, n in ((0, 1, 1000), (1, 1, 900), (0, 2, 1050), (1, 2, 960))]
    # turn 1: the 300-token system prompt; turn 2: the previous prompt and reply less its last token
    assert hit_ceiling(reqs, 300, 128) == 256 + 256 + 1015 // 128 * 128 + 915 // 128 * 128
    assert hit_ceiling(reqs, 300, 256) == 256 + 256 + 768 + 768
    # a prompt shorter than what came before is capped at its own length less one token
    assert hit_ceiling([{"user": 0, "turn": 1, "prompt_tokens": 200, "generated_tokens": 16}], 300, 64) == 192
