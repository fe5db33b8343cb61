"""The peer wires: engines share chunks over tcp (TLS), ZeroMQ (CURVE) or UCX, with placement, tenants and
admission; a client transport (:mod:`.client`) and a server (:mod:`.service`) per wire."""
