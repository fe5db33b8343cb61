"""Parts of the prefill/decode handoff that need no vLLM (:mod:`kvengine.integrations.vllm.handoff`):
the params a producer returns, prompt tails through a real engine and the page pipeline, and the holds.

The two-instance path on real vLLM engines is in test_vllm_disaggregation.py.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvengine import KVEngine, Namespace
from kvengine.errors import ConfigError, InvalidRequestError
from kvengine.integrations.vllm.copy_specs import LoadSpec
from kvengine.integrations.vllm.handoff import PARAMS_KEY, HandoffHolds, HandoffParams, HandoffServer, PromptTails
from kvengine.integrations.vllm.options import ConnectorOptions, HandoffOptions
from kvengine.integrations.vllm.paging import PagedCopier
from kvengine.integrations.vllm.pipeline import LayerPipeline, LoadJob

from .test_vllm_units import BS, CHUNK, RATIO, fill, make_layout

TOKENS = np.arange(100, 100 + 2 * CHUNK, dtype="<u4")
SRC = ((1, 2, 3, 4), (5, 6, 7, 8))
#: the producer a handed-off prompt names (no peer tier here: the tails are in this engine's memory)
PRODUCER = "127.0.0.1:7700"
DST = ((10, 11, 12, 13), (0, 0, 14, 15))  # out-of-window sliding blocks are null (0)


# ------------------------------------------------------------------ params --
def test_params_round_trip_through_kv_transfer_params():
    params = HandoffParams("10.0.0.2:7601", 1233, "ab" * 16)
    assert HandoffParams.from_transfer_params(params.to_transfer_params()) == params
    assert HandoffParams.from_transfer_params(None) is None
    assert HandoffParams.from_transfer_params({"do_remote_prefill": True}) is None  # another connector's
    through_store = HandoffParams("mooncake", 40, "ab" * 16)  # no server to dial: the shared store
    assert HandoffParams.from_transfer_params(through_store.to_transfer_params()) == through_store


@pytest.mark.parametrize("raw, field", [
    ("x", "must be a mapping"),
    ({"producer": "nohost", "tokens": 3, "namespace": "ab"}, "producer"),
    ({"producer": "h:1", "tokens": -1, "namespace": "ab"}, "tokens"),
    ({"producer": "h:1", "tokens": True, "namespace": "ab"}, "tokens"),
    ({"producer": "h:1", "tokens": 3, "namespace": ""}, "namespace"),
])
def test_malformed_params_are_refused_naming_the_field(raw, field):
    with pytest.raises(InvalidRequestError, match=field):
        HandoffParams.from_transfer_params({PARAMS_KEY: raw})


@pytest.mark.parametrize("handoff, message", [
    ({"listen": "7601"}, "handoff.listen must be 'host:port'"),
    ({"listen": "h:1", "advertize": "h:2"}, "unknown kv_connector_extra_config\\['handoff'\\] keys \\['advertize'\\]"),
    ({"tls_cert": ""}, "handoff.tls_cert must be a path"),
    ({"fetch_timeout": "30s"}, "handoff.fetch_timeout must be a number of seconds, got '30s'"),
    ({"fetch_timeout": 0}, "handoff.fetch_timeout must be in \\(0, 3600\\] seconds, got 0"),
    ("h:1", "must be a mapping"),
])
def test_bad_handoff_options_are_refused_by_name(handoff, message):
    with pytest.raises(ConfigError, match=message):
        ConnectorOptions.from_extra_config({"handoff": handoff})


def test_handoff_options_default_to_listen():
    options = ConnectorOptions.from_extra_config({"handoff": {"listen": "127.0.0.1:0"}}).handoff
    assert (options.listen, options.advertise, options.tls_cert) == ("127.0.0.1:0", None, None)
    assert options.fetch_timeout == 30.0
    assert ConnectorOptions.from_extra_config({"handoff": {"fetch_timeout": 4}}).handoff.fetch_timeout == 4.0


# ------------------------------------------------------------------ tails --
def _store_first_chunk(eng, binding, copier) -> None:
    """The first chunk of TOKENS, from the SRC blocks, in the engine (as a producer's save stores it)."""
    staged = eng.begin_store(binding, TOKENS[:CHUNK])
    for i, tensor in enumerate(staged.chunks[0].tensors):
        copier.gather_into(i, 0, SRC, 0, tensor)
    eng.commit_store(staged, 1)


@pytest.fixture
def setup():
    layout, caches = make_layout()
    fill(caches["full"])
    with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": "1MiB"}, "lease_seconds": 0.5},
                  transports=[]) as eng:
        copier = PagedCopier(layout, caches)
        yield layout, caches["full"], copier, eng, eng.bind(Namespace(model="handoff"), layout.chunk)


def test_a_tail_holds_the_pages_before_its_end_and_zeros_after(setup):
    layout, backing, copier, eng, binding = setup
    tails = PromptTails(eng, layout, copier, fetch_timeout=5.0)
    end = CHUNK + BS + 1  # the partial chunk: one whole block, then one token of the next
    assert tails.save(binding, TOKENS, end, SRC, 0)
    tail = tails.find(binding, TOKENS, end, tails.reads(PRODUCER))
    assert tail is not None and (tail.start, tail.end) == (CHUNK, end)
    kernel = BS // RATIO
    used = -(-(end - CHUNK) // kernel)  # kernel pages holding tokens of the tail: 3 of 4
    full = tail.tensors[0]
    assert torch.equal(full[:used], backing[3 * RATIO:3 * RATIO + used])  # blocks 3, 4 of the source
    assert not full[used:].any()
    # a tail is keyed by every token before its end: another prompt, or another length, finds nothing
    other = TOKENS.copy()
    other[0] += 1
    assert tails.find(binding, other, end, tails.reads(PRODUCER)) is None
    assert tails.find(binding, TOKENS, end - 1, tails.reads(PRODUCER)) is None


def test_a_tail_loads_after_the_chunks_and_only_up_to_its_end(setup):
    layout, backing, copier, eng, binding = setup
    tails = PromptTails(eng, layout, copier, fetch_timeout=5.0)
    end = CHUNK + BS + 1
    _store_first_chunk(eng, binding, copier)
    assert tails.save(binding, TOKENS, end, SRC, 0)
    before = backing.clone()
    res = eng.lookup(binding, "consumer", TOKENS[:end], max_tokens=end)
    assert res.tokens == CHUNK
    spec = LoadSpec(request_id="consumer", salt="", start=0, end=end, block_ids=DST, asynchronous=False)
    job = LoadJob(spec, res, eng.begin_load(res), 0, tail=tails.find(binding, TOKENS, end, tails.reads(PRODUCER)))
    pipe = LayerPipeline(copier, (0, 1))
    try:
        pipe.begin_loads([job])
        (done,) = pipe.end_loads()
    finally:
        pipe.close()
    eng.finish_load(res, done.loaded)
    assert done.tail_loaded and done.loaded == 1
    kernel = BS // RATIO
    # full attention: the whole chunk and the tail's pages up to its end, no further
    assert torch.equal(backing[10 * RATIO:12 * RATIO], before[1 * RATIO:3 * RATIO])
    used = -(-(end - CHUNK) // kernel)
    assert torch.equal(backing[12 * RATIO:12 * RATIO + used], before[3 * RATIO:3 * RATIO + used])
    assert torch.equal(backing[12 * RATIO + used:14 * RATIO], before[12 * RATIO + used:14 * RATIO])


# ------------------------------------------------------------------ holds --
def test_a_hold_pins_the_prompt_until_the_consumer_fetches_its_last_record(setup):
    layout, backing, copier, eng, binding = setup
    staged = eng.begin_store(binding, TOKENS)
    for view in staged.chunks:
        for i, tensor in enumerate(view.tensors):
            copier.gather_into(i, view.token_range[0], SRC, 0, tensor)
    eng.commit_store(staged, len(staged.chunks))
    tails = PromptTails(eng, layout, copier, fetch_timeout=5.0)
    events: list[str] = []
    holds = HandoffHolds(eng, 60.0, events.append)
    last = tails.last_key(binding, TOKENS, 2 * CHUNK)
    holds.hold(last, binding, "r", TOKENS, 2 * CHUNK)
    assert len(holds) == 1 and eng._core.memory.total_pins() == 2
    holds.confirm([tails.last_key(binding, TOKENS, CHUNK)])  # another record: the hold stays
    assert len(holds) == 1
    holds.confirm([last])
    assert len(holds) == 0 and eng._core.memory.total_pins() == 0 and events == ["hold_confirmed"]


def test_an_unclaimed_hold_expires_and_is_counted(setup):
    layout, backing, copier, eng, binding = setup
    _store_first_chunk(eng, binding, copier)
    tails = PromptTails(eng, layout, copier, fetch_timeout=5.0)
    events: list[str] = []
    holds = HandoffHolds(eng, 0.2, events.append)
    holds.hold(tails.last_key(binding, TOKENS, CHUNK), binding, "r", TOKENS, CHUNK)
    assert eng._core.memory.total_pins() == 1
    time.sleep(0.3)
    holds.sweep()
    assert len(holds) == 0 and events == ["hold_expired"] and eng._core.memory.total_pins() == 0


def test_a_fetch_after_the_lease_counts_as_expired_not_confirmed(setup):
    """The engine's lease already reclaimed the pins: the late read ends nothing, and says so."""
    layout, backing, copier, eng, binding = setup
    _store_first_chunk(eng, binding, copier)
    tails = PromptTails(eng, layout, copier, fetch_timeout=5.0)
    events: list[str] = []
    holds = HandoffHolds(eng, 0.2, events.append)
    last = tails.last_key(binding, TOKENS, CHUNK)
    holds.hold(last, binding, "r", TOKENS, CHUNK)
    time.sleep(0.3)
    holds.confirm([last])
    assert events == ["hold_expired"] and len(holds) == 0


def _consumer_desk(setup, model: str, fetch_timeout: float):
    """A consumer's reservation desk over the setup's engine, with its prompt tails; the first chunk of
    TOKENS stored in its binding. Returns (engine, tails, desk, binding)."""
    pytest.importorskip("vllm")
    from kvengine.integrations.vllm.worker import ReservationDesk

    layout, _backing, copier, eng, _ = setup
    tails = PromptTails(eng, layout, copier, fetch_timeout=fetch_timeout)
    desk = ReservationDesk(eng, Namespace(model=model), layout.chunk, tails=tails)
    binding = desk.binding("")
    _store_first_chunk(eng, binding, copier)
    return eng, tails, desk, binding


def test_the_desk_offers_a_handed_off_prompt_through_its_tail_only_when_asked(setup):
    """A consumer's lookup (``producer`` set) offers the whole chunks and the tail after them; a plain lookup of
    the same tokens only the chunks; a prompt shorter than a chunk is a tail alone; a missing tail leaves the
    chunks. What the desk holds is what its load takes, and releasing it leaves no pin."""
    eng, tails, desk, binding = _consumer_desk(setup, "handoff-desk", fetch_timeout=5.0)
    from kvengine.integrations.vllm.scheduler import token_bytes  # vLLM's (skipped above without it)

    end, short = CHUNK + BS + 1, BS + 3
    assert tails.save(binding, TOKENS, end, SRC, 0) and tails.save(binding, TOKENS, short, SRC, 0)
    data = token_bytes(TOKENS[:end])
    assert desk.lookup("plain", "", data, end).loadable == CHUNK
    assert desk.lookup("handed", "", data, end, producer=PRODUCER).loadable == end
    taken = desk.take("handed")
    assert taken.hit.tokens == CHUNK and (taken.tail.start, taken.tail.end) == (CHUNK, end)
    eng.release(taken.hit)
    assert desk.lookup("short", "", token_bytes(TOKENS[:short]), short, producer=PRODUCER).loadable == short
    alone = desk.take("short")
    assert alone.hit is None and (alone.tail.start, alone.tail.end) == (0, short)
    assert desk.lookup("gone", "", data, end - 1, producer=PRODUCER).loadable == CHUNK  # no tail of that length
    desk.release("gone")
    desk.release("plain")
    assert eng._core.memory.total_pins() == 0 and len(desk) == 0


def test_the_desk_waits_for_a_prompt_handed_off_through_mooncake_until_the_fetch_timeout(setup):
    """A prompt handed off through Mooncake may still be on its way to the store: the consumer's lookup asks
    again until all of it is there (here: its tail lands 0.3 s late), or ``fetch_timeout`` ends (a tail never
    stored: the chunks alone, after the timeout and no later)."""
    import threading

    from kvengine.integrations.vllm.handoff import VIA_MOONCAKE

    eng, tails, desk, binding = _consumer_desk(setup, "handoff-mooncake", fetch_timeout=1.5)
    from kvengine.integrations.vllm.scheduler import token_bytes  # vLLM's (skipped above without it)

    end = CHUNK + BS + 1
    late = threading.Timer(0.3, lambda: tails.save(binding, TOKENS, end, SRC, 0))
    late.start()
    t = time.monotonic()
    assert desk.lookup("late", "", token_bytes(TOKENS[:end]), end, producer=VIA_MOONCAKE).loadable == end
    assert 0.3 <= time.monotonic() - t < 1.5
    late.join()
    desk.release("late")
    t = time.monotonic()
    missing = desk.lookup("never", "", token_bytes(TOKENS[:end + 1]), end + 1, producer=VIA_MOONCAKE)
    assert missing.loadable == CHUNK  # what is there, once the wait ends
    assert 1.4 <= time.monotonic() - t < 3.0
    desk.release("never")
    assert eng._core.memory.total_pins() == 0 and len(desk) == 0

# ------------------------------------------------------------------ wires --
class _Events:
    """The handoff server's Prometheus counter, reduced to what it counts (unit-level isolation)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def labels(self, event: str) -> Any:
        return SimpleNamespace(inc=lambda: self.seen.append(event))


def _curve_keys() -> tuple[str, str]:
    import zmq

    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


@pytest.mark.parametrize("wire", ["tcp", "zmq", "ucx", "zmq-curve"])
def test_a_consumer_fetches_a_handed_off_prompt_over_the_producers_wire(wire, tmp_path):
    """A producer's handoff server speaks its ``peers.transport``; a consumer on that wire (real sockets, a real
    engine each side) reads the prompt's chunk and tail from it, bytes intact, and the read ends the hold. With
    CURVE, the producer admits the consumers ``handoff.curve_allow`` lists: another key reads nothing."""
    if wire == "ucx":
        pytest.importorskip("ucxx", reason="the 'ucx' extra (ucxx-cu12) is not installed")

    layout, caches = make_layout()
    fill(caches["full"])
    copier = PagedCopier(layout, caches)
    secret = tmp_path / "group.key"
    secret.write_bytes(b"s" * 32)
    peers: dict[str, Any] = {"transport": wire.split("-")[0], "secret_file": str(secret)}
    consumer_peers, handoff = dict(peers), HandoffOptions(listen="127.0.0.1:0")
    if wire == "zmq-curve":
        (pub, sec), (client_pub, client_sec), (stranger_pub, stranger_sec) = (_curve_keys() for _ in range(3))
        peers.update(curve_public_key=pub, curve_secret_key=sec)
        consumer_peers.update(curve_public_key=client_pub, curve_secret_key=client_sec, curve_server_key=pub)
        handoff = HandoffOptions(listen="127.0.0.1:0", curve_allow=(client_pub,))
    end = CHUNK + BS + 1
    namespace = Namespace(model="handoff-wire")
    with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": "1MiB"}, "peers": peers},
                  transports=[]) as producer:
        binding = producer.bind(namespace, layout.chunk)
        events = _Events()
        server = HandoffServer.start(producer, handoff, events)
        try:
            tails = PromptTails(producer, layout, copier, fetch_timeout=5.0)
            _store_first_chunk(producer, binding, copier)
            assert tails.save(binding, TOKENS, end, SRC, 0)
            server.share(binding, tails.binding(binding))
            server.holds.hold(tails.last_key(binding, TOKENS, end), binding, "r", TOKENS, CHUNK)
            assert producer._core.memory.total_pins() == 1
            if wire == "zmq-curve":  # a key the producer does not list: nothing read, the hold stands
                stranger = {**consumer_peers, "curve_public_key": stranger_pub, "curve_secret_key": stranger_sec,
                            "peers": [server.address], "replicas": 1, "request_timeout": 0.3, "read_deadline": 0.5}
                with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": "1MiB"}, "peers": stranger}) as other:
                    outsider = PromptTails(other, layout, copier, fetch_timeout=1.0)
                    assert outsider.find(other.bind(namespace, layout.chunk), TOKENS, end,
                                         outsider.reads(server.address)) is None
                assert events.seen == [] and producer._core.memory.total_pins() == 1
            with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": "1MiB"},
                           "peers": {**consumer_peers, "peers": [server.address], "replicas": 1}}) as consumer:
                theirs = consumer.bind(namespace, layout.chunk)
                assert theirs.digest == binding.digest
                consumed = PromptTails(consumer, layout, copier, fetch_timeout=5.0)
                res = consumer.lookup(theirs, "c", TOKENS[:end], max_tokens=end,
                                      reads=consumed.reads(server.address))
                assert res.tokens == CHUNK
                consumer.release(res)
                tail = consumed.find(theirs, TOKENS, end, consumed.reads(server.address))
                assert tail is not None and (tail.start, tail.end) == (CHUNK, end)
                want = tails.find(binding, TOKENS, end, None)
                assert want is not None
                assert all(torch.equal(a, b) for a, b in zip(tail.tensors, want.tensors))
            assert events.seen == ["hold_confirmed"] and producer._core.memory.total_pins() == 0
        finally:
            server.stop()


@pytest.mark.parametrize("wire, handoff, message", [
    ("zmq", {"tls_cert": "/x.pem"}, "handoff.tls_cert/tls_key are settings of the tcp wire; this producer's "
                                    "peers.transport is 'zmq'"),
    ("tcp", {"curve_allow": ["k" * 40]}, r"handoff.curve_allow .*are settings of the zmq wire; this producer's "
                                         "peers.transport is 'tcp'"),
    ("zmq", {"curve_allow": ["k" * 40]}, "handoff.curve_allow needs this producer's CURVE keys"),
    ("zmq", {"listen": "10.1.2.3:0"}, "handoff.listen 10.1.2.3:0 is off loopback: on the zmq wire"),
    ("ucx", {"listen": "10.1.2.3:0"}, "handoff.listen 10.1.2.3:0 is not on loopback"),
])
def test_a_handoff_server_refuses_another_wires_options_and_an_unprotected_address(wire, handoff, message):

    options = HandoffOptions.from_extra({"listen": "127.0.0.1:0", **handoff})
    with KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": "1MiB"}, "peers": {"transport": wire}},
                  transports=[]) as eng:
        with pytest.raises(ConfigError, match=message):
            HandoffServer.start(eng, options, _Events())


def test_curve_allow_must_be_a_list_of_keys():
    with pytest.raises(ConfigError, match="handoff.curve_allow must be a list of CURVE public keys"):
        HandoffOptions.from_extra({"curve_allow": "k" * 40})
