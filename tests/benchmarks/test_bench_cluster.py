"""The cluster benchmark's schedule, placement and summary, on hand-built inputs."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

from bench_cluster import place_by_cache, place_round_robin, schedule, summarize


def test_the_schedule_is_seeded_and_never_leaves_a_round_empty():
    first = schedule(8, 20, 0.5, seed=3)
    assert first == schedule(8, 20, 0.5, seed=3)  # the same in every arm
    assert all(order and len(set(order)) == len(order) and set(order) <= set(range(8)) for order in first)
    assert any(len(order) < 8 for order in first)  # users come and go
    assert all(len(order) == 1 for order in schedule(8, 5, 0.0))


def test_round_robin_follows_arrival_order_and_continues_the_rotation():
    assert place_round_robin([5, 2, 7], 2, start=1) == {5: 1, 2: 0, 7: 1}


def test_the_cache_aware_placement_prefers_the_longest_prefix_within_the_load_cap():
    cached = {0: [(512, 512), (0, 0)], 1: [(512, 512), (0, 0)], 2: [(512, 512), (0, 0)],
              3: [(256, 0), (256, 256)]}
    # the cap is 2 per instance: user 2 moves to instance 1 although instance 0 holds more of it
    assert place_by_cache([0, 1, 2, 3], cached, 2) == {0: 0, 1: 0, 2: 1, 3: 1}
    # equal prefixes: the one on the instance's own media wins, then the less loaded instance
    assert place_by_cache([3], cached, 2) == {3: 1}
    assert place_by_cache([0, 1], {0: [(0, 0), (0, 0)], 1: [(0, 0), (0, 0)]}, 2) == {0: 0, 1: 1}


def test_cross_instance_hits_are_what_the_serving_instance_never_computed_for_the_user():
    reqs = [{"round": 0, "user": 0, "turn": 1, "instance": 0, "moved": False, "prompt_tokens": 1000,
             "generated_tokens": 16, "cached_tokens": 256, "ttft_s": 1.0, "e2e_s": 2.0},
            {"round": 1, "user": 0, "turn": 2, "instance": 1, "moved": True, "prompt_tokens": 1100,
             "generated_tokens": 16, "cached_tokens": 1024, "ttft_s": 0.5, "e2e_s": 1.0},
            {"round": 2, "user": 0, "turn": 3, "instance": 1, "moved": False, "prompt_tokens": 1200,
             "generated_tokens": 16, "cached_tokens": 1088, "ttft_s": 0.25, "e2e_s": 1.0}]
    stats = [{"vllm_stats": {"preemptions": 1}, "metrics": {'kvengine_loaded_bytes_total{tier="mooncake"}': 4e6,
                                                            'kvengine_tier_read_seconds_sum{tier="mooncake"}': 0.02}},
             {"vllm_stats": {}}]
    s = summarize({"requests": reqs, "rounds_s": [2.0, 1.0, 1.0], "stats": stats, "machine_during": {}}, 300)
    assert s["moved_turns"] == 1 and s["later_turns"] == 2
    # the moved turn's history beyond the system prompt came from elsewhere; the next turn's, from its own instance
    assert s["moved_cached_rate"] == 1024 / 1100 and s["cross_instance_hit_tokens"] == 1024 - 300
    assert s["prompt_tok_per_s"] == 3300 / 4.0 and s["preemptions"] == 1
    assert s["mooncake_read_ms_per_mb"] == 5.0 and s["mooncake_bytes_per_moved_turn"] == 4e6
