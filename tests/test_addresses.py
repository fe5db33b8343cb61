"""``host:port`` parsing shared by peers, servers, the Mooncake master and the vLLM handoff options."""

from __future__ import annotations

import re

import pytest

from kvengine.addresses import format_address, offset_port, split_host_port
from kvengine.errors import ConfigError


@pytest.mark.parametrize("text, want", [("10.0.0.1:7600", ("10.0.0.1", 7600)), ("tcp://node-a:1", ("node-a", 1)),
                                        ("[::1]:65535", ("::1", 65535)), (" h:0 ", ("h", 0))])
def test_addresses_parse_to_host_and_port(text, want):
    assert split_host_port(text) == want
    assert split_host_port(format_address(*want)) == want


@pytest.mark.parametrize("text", ["7600", "host", ":7600", "host:", "host:port", "host:65536", "[]:1"])
def test_malformed_addresses_are_refused_by_name(text):
    with pytest.raises(ConfigError, match=re.escape(f"address must be 'host:port', got {text!r}")):
        split_host_port(text)


def test_a_port_a_client_dials_may_not_be_zero():
    assert split_host_port("h:0") == ("h", 0)  # a server binding: the OS picks the port
    with pytest.raises(ConfigError, match="got 'h:0'"):
        split_host_port("h:0", any_port=False)


def test_a_port_offset_keeps_the_host_and_stays_a_port():
    assert offset_port("10.0.0.1:7600", 0) == "10.0.0.1:7600"
    assert offset_port("10.0.0.1:7600", 3) == "10.0.0.1:7603"
    assert offset_port("[::1]:7600", 1) == "[::1]:7601"
    with pytest.raises(ConfigError, match="port 65535 of 'h:65535' \\+ 1 is not a port"):
        offset_port("h:65535", 1)
