"""Tenant access control on a peer server: the tenants file, namespace claims, and the service's verdicts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvengine.chunks.keys import Namespace
from kvengine.errors import ConfigError
from kvengine.transports.peers.protocol import Limits, Op, decode_header, encode_request, split_frames
from kvengine.transports.peers.service import PeerService, ServerOptions
from kvengine.transports.peers.store import MemoryRecordStore
from kvengine.transports.peers.tcp import TcpPeerServer, TcpServerOptions
from kvengine.transports.peers.tenants import ClaimBook, Gatekeeper, load_tenants
from kvengine.transports.peers.zmq import ZmqPeerServer
from tests.transports.peers.certs import Pki

MiB = 1 << 20
A, A_READ, B = (zmq.curve_keypair()[0] for _ in range(3))
NS_A, NS_PINNED = Namespace(model="a").digest(), Namespace(model="a-pinned").digest()


def tenants_file(tmp_path: Path, **override: Any) -> Path:
    body = {"tenants": {"a": {"writers": [A.decode()], "readers": [A_READ.decode()], "namespaces": [NS_PINNED.hex()]},
                        "b": {"writers": [B.decode()]}}}
    body.update(override)
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(body))
    return path


async def ask(service: PeerService, op: Op, client: bytes, items: list[tuple[Any, bytes]]) -> tuple[bool, ...]:
    records = [r for _, r in items] if op is Op.PUT else []
    reply = await service.handle(encode_request(op, 1, [k for k, _ in items], [len(r) for r in records]),
                                 split_frames(records, MiB), client)
    assert reply is not None
    return decode_header(reply.header, Limits(), reply=True).flags


async def test_a_namespace_belongs_to_its_first_writer_and_only_its_tenant_may_touch_it(
        tmp_path: Path, make_record: Any) -> None:
    """The first writer's tenant claims a namespace: other tenants, read-only keys and unknown keys are denied,
    counted; pinned namespaces stay their tenant's, and claims survive a restart."""
    gate = Gatekeeper(load_tenants(tenants_file(tmp_path)), ClaimBook(tmp_path / "claims.json"))
    service = PeerService(MemoryRecordStore(MiB), ServerOptions(tenants=gate))
    item = make_record(100, namespace=NS_A)
    assert await ask(service, Op.PUT, A, [item]) == (True,)  # claims NS_A for tenant a
    assert gate.owner(NS_A) == "a"
    assert await ask(service, Op.GET, A_READ, [item]) == (True,)  # a's reader reads
    assert await ask(service, Op.EXISTS, B, [item]) == (False,)  # b sees nothing of a's
    assert await ask(service, Op.GET, B, [item]) == (False,)
    assert await ask(service, Op.DELETE, B, [item]) == (False,)
    assert await ask(service, Op.PUT, B, [make_record(100, namespace=NS_A)]) == (False,)
    assert await ask(service, Op.PUT, A_READ, [make_record(100, namespace=NS_A)]) == (False,)  # read-only
    assert await ask(service, Op.DELETE, A_READ, [item]) == (False,)
    assert await ask(service, Op.PUT, B, [make_record(100, namespace=NS_PINNED)]) == (False,)  # pinned to a
    assert await ask(service, Op.GET, b"x" * 40, [item]) == (False,)  # a key granted nothing
    assert await service.store.exists([item[0]]) == [True]
    assert service.counts["denied_read"] == 3 and service.counts["denied_write"] == 5
    # claims survive a restart: tenant b cannot have NS_A after it
    again = Gatekeeper(load_tenants(tenants_file(tmp_path)), ClaimBook(tmp_path / "claims.json"))
    assert again.owner(NS_A) == "a" and not again.claim(B, NS_A)


@pytest.mark.parametrize("change, message", [
    ({"tenants": {}}, "non-empty"),
    ({"tenants": {"a": {"writers": ["short"]}}}, "neither a 40-character Z85 CURVE key nor a 'sha256:"),
    ({"tenants": {"a": {"writers": ["sha256:" + "0" * 63]}}}, "neither a 40-character Z85"),
    ({"tenants": {"a": {"writers": [A.decode()]}, "b": {"readers": [A.decode()]}}}, "granted twice"),
    ({"tenants": {"a": {"writers": [A.decode()], "namespaces": ["zz"]}}}, "not a namespace digest"),
    ({"tenants": {"a": {"writers": [A.decode()], "namespaces": [NS_A.hex()]},
                  "b": {"writers": [B.decode()], "namespaces": [NS_A.hex()]}}}, "pinned to two tenants"),
    ({"tenants": {"a": {"writer": [A.decode()]}}}, "must be an object with writers"),
])
def test_a_bad_tenants_file_is_refused_naming_the_entry(tmp_path: Path, change: dict, message: str) -> None:
    """An invalid tenants file (empty, bad keys, a key granted twice, bad or doubly pinned namespaces, bad
    entries) is refused naming the fault."""
    with pytest.raises(ConfigError, match=message):
        load_tenants(tenants_file(tmp_path, **change))


def test_an_unreadable_claims_file_refuses_to_start(tmp_path: Path) -> None:
    """A claims file that is not valid JSON is a ConfigError."""
    (tmp_path / "claims.json").write_text("{not json")
    with pytest.raises(ConfigError, match="claims file"):
        ClaimBook(tmp_path / "claims.json")


def test_tenants_need_a_wire_that_proves_the_client_key(tmp_path: Path) -> None:
    """Tenants are refused without a wire that proves the client key: ZeroMQ needs a CURVE allow-list, tcp TLS with
    a client CA."""
    gate = Gatekeeper(load_tenants(tenants_file(tmp_path)))
    with pytest.raises(ConfigError, match="CURVE with an allow-list"):
        ZmqPeerServer(MemoryRecordStore(MiB), "127.0.0.2:0", ServerOptions(tenants=gate))
    from kvengine.cli.serve import main as serve

    assert serve(["--bind", "127.0.0.2:0", "--tenants", str(tenants_file(tmp_path))]) == 1
    with pytest.raises(ConfigError, match="tenants need TLS with a client CA"):
        TcpPeerServer(MemoryRecordStore(MiB), "127.0.0.2:0", ServerOptions(tenants=gate))


def test_tls_tenants_are_granted_by_certificate_fingerprint(tmp_path: Path) -> None:
    """A tenants file may name TLS clients by fingerprint; a TLS server refuses one that names CURVE keys."""
    fp = "sha256:" + "ab" * 32
    policy = load_tenants(tenants_file(tmp_path, tenants={"a": {"writers": [fp]}}))
    assert policy.grants[fp.encode()].tenant == "a"
    pki = Pki.create(tmp_path / "pki")
    curve_gate = Gatekeeper(load_tenants(tenants_file(tmp_path)))
    with pytest.raises(ConfigError, match="by certificate fingerprint"):
        TcpPeerServer(MemoryRecordStore(MiB), "127.0.0.2:0", ServerOptions(tenants=curve_gate),
                      TcpServerOptions(tls=pki.tls("server")))


async def test_with_a_secret_a_delete_removes_only_records_that_fail_verification(make_record: Any) -> None:
    """A DELETE is a report of a bad copy: with a secret the server checks the record first, so a client
    without the secret cannot starve others by deleting their chunks."""
    from kvengine.chunks.record import seal_record

    secret = b"the-group-secret-0123456789"
    store = MemoryRecordStore(MiB)
    service = PeerService(store, ServerOptions(secret=secret))
    good_key, record = make_record(100)
    bad_key, unsealed = make_record(100)
    await store.put([(good_key, bytes(seal_record(memoryview(record), secret))), (bad_key, unsealed)])
    reply = await service.handle(encode_request(Op.DELETE, 1, [good_key, bad_key]), [])
    assert reply is not None
    assert decode_header(reply.header, Limits(), reply=True).flags == (False, True)
    assert await store.exists([good_key, bad_key]) == [True, False]
    assert service.counts["delete_refused_record_valid"] == 1
