"""The etcd transport's pure parts: endpoint lists and prefix ranges (no etcd needed)."""

from __future__ import annotations

import pytest

from megatron_mecefo.recovery.etcd_transport import parse_endpoints, prefix_end


def test_parse_endpoints() -> None:
    assert parse_endpoints("a:1, http://b:2 ,c:3") == ["a:1", "b:2", "c:3"]
    assert parse_endpoints(["h:2379"]) == ["h:2379"]
    for bad, why in (
        ("", "no etcd endpoint"),
        ("a:1,b", "'b' is not HOST:PORT"),
        (":1", "':1' is not HOST:PORT"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_endpoints(bad)


def test_prefix_end_covers_exactly_the_prefix() -> None:
    end = prefix_end(b"/job/dead/")
    assert end == b"/job/dead0"
    inside = [b"/job/dead/", b"/job/dead/3/1", b"/job/dead/\xff\xff"]
    outside = [b"/job/dead", b"/job/dead0", b"/job/deaf"]
    assert all(b"/job/dead/" <= k < end for k in inside)
    assert not any(b"/job/dead/" <= k < end for k in outside)
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff") == b"\0"  # all keys: etcd's range_end for "everything after"
