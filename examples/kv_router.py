"""A KV-aware router over kvengine instances: it reads their KV events and sends a prompt where most of
its prefix is cached.

Every instance publishes its chunks entering and leaving tiers (``events`` in its configuration; vLLM's
wire format, see docs/kv_events.md). The router subscribes to each instance's stream and keeps which
instance holds which chunk hash, on which media. For a prompt it computes the chunk hashes each instance
would use (``prefix_hashes`` with that instance's namespace digest and chunk size) and ranks the
instances by the longest prefix they hold; for an instance whose binding stores tails (``tail_step``,
the vLLM connector's default), that prefix may end in a chunk's leading whole steps
(``chunk_tails``: the keys the engine gives such tails). Batches missed (ZeroMQ drops what is published before a
subscription arrives) are fetched from the instance's replay endpoint: a gap in the sequence numbers,
or :meth:`KVRouter.catch_up`, asks for them.

Run it: ``python examples/kv_router.py`` starts two engines in this process, stores prompts in them,
and ranks both for a few prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import zmq

from kvengine import ChunkLayout, KVCategory, KVEngine, Namespace, TensorSpec
from kvengine.chunks.hashing import chunk_tails, prefix_hashes
from kvengine.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventPublisher,
    decode_batch,
)


@dataclass(frozen=True)
class Instance:
    """An inference instance as the router sees it: where its events are, and how it hashes prompts."""

    name: str
    endpoint: str  # its events endpoint (bound by the instance, connected to here)
    digest: bytes  # its model binding's namespace digest (ModelBinding.digest), the seed of its hashes
    chunk_size: int
    replay_endpoint: str | None = None
    tail_step: int = 0  # its binding's tail_step (ModelBinding.tail_step): hits may end at a whole step of it

    @classmethod
    def from_metrics(cls, name: str, metrics_url: str, endpoint: str, replay_endpoint: str | None = None) -> Instance:
        """A vLLM instance with the kvengine connector, as its worker reports itself on its metrics endpoint
        (``metrics_port``): namespace digest, chunk size and tail step."""
        from kvengine.metrics import parse_key, scrape_url

        samples = scrape_url(metrics_url)
        digests = [parse_key(k)[1]["digest"] for k in samples if k.startswith("kvengine_vllm_namespace_info{")]
        if len(digests) != 1:
            raise ValueError(f"{metrics_url} reports no kvengine_vllm_namespace_info (not a vLLM worker with the "
                             "kvengine connector?)")
        return cls(name, endpoint, bytes.fromhex(digests[0]), int(samples["kvengine_vllm_chunk_tokens"]),
                   replay_endpoint, int(samples.get("kvengine_vllm_tail_step_tokens", 0)))


class KVRouter:
    """An index of chunk hash -> media per instance, fed by the instances' KV events.

    ``shared_media``: media every instance reads (a Mooncake Store, ``"MOONCAKE"``): a chunk one instance put
    there is cached for all of them.
    """

    def __init__(self, instances: Sequence[Instance], shared_media: frozenset[str] = frozenset()) -> None:
        self.instances = {i.name: i for i in instances}
        self.shared_media = shared_media
        self._shared: dict[BlockHash, int] = {}  # chunk -> how many (instance, shared medium) pairs hold it
        self._ctx = zmq.Context()
        self._subs: dict[zmq.Socket, str] = {}
        self._poller = zmq.Poller()
        for instance in instances:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(instance.endpoint)
            self._subs[sock] = instance.name
            self._poller.register(sock, zmq.POLLIN)
        self.held: dict[str, dict[BlockHash, set[str]]] = {i.name: {} for i in instances}
        self._next_seq = dict.fromkeys(self.instances, 0)

    # -- events ---------------------------------------------------------------------------------------
    def poll(self, timeout: float = 0.0) -> int:
        """Apply every message that arrives within ``timeout`` seconds of the last one; how many."""
        applied = 0
        while True:
            ready = dict(self._poller.poll(int(timeout * 1000)))
            if not ready:
                return applied
            for sock in ready:
                _topic, seq, payload = sock.recv_multipart()
                self._receive(self._subs[sock], int.from_bytes(seq, "big"), decode_batch(payload))
                applied += 1

    def catch_up(self) -> None:
        """Fetch what each instance published that was not received (from its replay endpoint, if any)."""
        for name in self.instances:
            self._replay(name)

    def _receive(self, name: str, seq: int, batch: EventBatch) -> None:
        if seq < self._next_seq[name]:
            return  # seen already (replayed)
        if seq > self._next_seq[name]:
            self._replay(name, until=seq)  # a gap: batches were lost on the way
        self._apply(name, batch)
        self._next_seq[name] = seq + 1

    def _replay(self, name: str, until: int | None = None) -> None:
        endpoint = self.instances[name].replay_endpoint
        if endpoint is None:
            return
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        try:
            sock.send_multipart((b"", self._next_seq[name].to_bytes(8, "big")))
            while sock.poll(2000):
                _, _topic, seq_bytes, payload = sock.recv_multipart()
                if seq_bytes == END_SEQ:
                    break
                seq = int.from_bytes(seq_bytes, "big")
                if seq == self._next_seq[name] and (until is None or seq < until):
                    self._apply(name, decode_batch(payload))
                    self._next_seq[name] = seq + 1
        finally:
            sock.close()

    def _apply(self, name: str, batch: EventBatch) -> None:
        held = self.held[name]
        for event in batch.events:
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    media = held.setdefault(h, set())
                    if event.medium in self.shared_media and event.medium not in media:
                        self._shared[h] = self._shared.get(h, 0) + 1
                    media.add(event.medium)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    media = held.get(h)
                    if media is not None and event.medium in media:
                        self._unshare(h, event.medium)
                        media.discard(event.medium)
                        if not media:
                            del held[h]
            elif isinstance(event, AllBlocksCleared):
                for h, media in held.items():
                    for medium in media:
                        self._unshare(h, medium)
                held.clear()

    def _unshare(self, h: BlockHash, medium: str) -> None:
        if medium in self.shared_media:
            left = self._shared[h] - 1
            if left:
                self._shared[h] = left
            else:
                del self._shared[h]

    # -- routing ---------------------------------------------------------------------------------------
    def cached_tokens(self, name: str, tokens: Sequence[int], *, local: bool = False) -> int:
        """Tokens of the longest prefix of ``tokens`` instance ``name`` can load: on any of its media, or on a
        shared medium any instance put it on; ``local``: on its own media only."""
        return self.cached(name, tokens)[1 if local else 0]

    def cached(self, name: str, tokens: Sequence[int]) -> tuple[int, int]:
        """:meth:`cached_tokens` of ``tokens`` on instance ``name``, and of them on its own media (the prompt
        hashed once for both)."""
        instance = self.instances[name]
        held = self.held[name]
        hashes = prefix_hashes(tokens, instance.chunk_size, instance.digest)
        return (self._held_prefix(instance, tokens, hashes, lambda h: h in held or h in self._shared),
                self._held_prefix(instance, tokens, hashes, held.__contains__))

    @staticmethod
    def _held_prefix(instance: Instance, tokens: Sequence[int], hashes: Sequence[BlockHash],
                     has: Callable[[BlockHash], bool]) -> int:
        matched = 0
        for h in hashes:
            if not has(h):
                break
            matched += 1
        # the chunk the chain broke at: its longest tail held
        for end, h in chunk_tails(tokens, hashes, instance.digest, instance.chunk_size, instance.tail_step, matched,
                                  len(tokens)):
            if has(h):
                return end
        return matched * instance.chunk_size

    def rank(self, tokens: Sequence[int]) -> list[tuple[str, int]]:
        """Instances by cached prefix of ``tokens``, longest first; of equal prefixes, the one holding more of
        it on its own media (a shared medium's chunks cross the network); then by name."""
        found = {name: self.cached(name, tokens) for name in self.instances}
        return [(name, found[name][0]) for name in sorted(found, key=lambda n: (-found[n][0], -found[n][1], n))]

    def close(self) -> None:
        self._ctx.destroy(linger=0)


# -- the demo -----------------------------------------------------------------------------------------
CHUNK = 16
STEP = 4  # tails: hits end at a whole step of 4 tokens past the last whole chunk


def _layout() -> ChunkLayout:
    return ChunkLayout(CHUNK, tuple(
        TensorSpec(name=f"layer{i}", group=0, category=KVCategory.FULL_ATTENTION, dtype=torch.float32,
                   shape=(2, 2, CHUNK, 8), token_dim=2) for i in range(2)))


def _engine() -> KVEngine:
    """An engine publishing its KV events on a loopback port of its own, with a replay endpoint."""
    return KVEngine({"chunk_size": CHUNK, "memory": {"capacity_bytes": "16MiB"},
                     "events": {"endpoint": "tcp://127.0.0.1:0", "bind": True,
                                "replay_endpoint": "tcp://127.0.0.1:0"}})


def _events(engine: KVEngine) -> KVEventPublisher:
    """The engine's KV event publisher (on: :func:`_engine` configures it)."""
    events = engine.kv_events
    assert events is not None
    return events


def _store(engine: KVEngine, binding, tokens: list[int]) -> None:
    kv = [torch.randn(2, 2, len(tokens), 8) for _ in range(2)]
    engine.store(binding, tokens, lambda i, start, end: [t[:, :, start:end] for t in kv])


def main() -> None:
    namespace = Namespace(model="demo-model", model_fingerprint="demo-weights")
    engines = {"instance-a": _engine(), "instance-b": _engine()}
    try:
        bindings = {name: engine.bind(namespace, _layout(), tail_step=STEP) for name, engine in engines.items()}
        router = KVRouter([
            Instance(name, _events(engine).endpoint, bindings[name].digest, CHUNK, _events(engine).replay_endpoint,
                     STEP)
            for name, engine in engines.items()])
        document = list(range(1000, 1000 + 4 * CHUNK))  # a shared document, 4 chunks
        question = list(range(5000, 5000 + 2 * CHUNK))
        _store(engines["instance-a"], bindings["instance-a"], document + question)  # 6 chunks
        # 2 chunks and a tail: 42 tokens store down to a whole step, the third chunk's first 8 tokens
        _store(engines["instance-b"], bindings["instance-b"], document[: 2 * CHUNK + 10])
        router.poll(0.5)
        router.catch_up()  # what was published before the subscriptions arrived
        prompts = {
            "document + question + more": document + question[:CHUNK] + list(range(9000, 9000 + 20)),
            "document's first half + other": document[: 2 * CHUNK] + list(range(7000, 7000 + 40)),
            "unrelated": list(range(300, 300 + 3 * CHUNK)),
        }
        for label, tokens in prompts.items():
            ranking = ", ".join(f"{name} {cached}" for name, cached in router.rank(tokens))
            print(f"{label} ({len(tokens)} tokens): cached tokens by instance: {ranking}")
        engines.pop("instance-a").close()  # publishes AllBlocksCleared: the router forgets its chunks
        router.poll(0.5)
        ranking = ", ".join(f"{name} {cached}" for name, cached in router.rank(prompts["document + question + more"]))
        print(f"after instance-a closed: cached tokens by instance: {ranking}")
        router.close()
    finally:
        for engine in engines.values():
            engine.close()


if __name__ == "__main__":
    main()
