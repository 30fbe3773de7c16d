"""kvgate.ring: nginx's ketama ring rebuilt in Python, checked against an independent CRC-32
written the way nginx's ngx_crc32_init/update/final are (tests/integration/test_ring_nginx.py
checks it against nginx itself)."""

from __future__ import annotations

import collections
import struct

import pytest

from kvgate.policy.loader import parse_policy
from kvgate.ring import DOWN_WEIGHT, Ring, key_point, pool_ring, server_points, split_server


def _table() -> list[int]:
    out = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0xEDB88320 if c & 1 else c >> 1
        out.append(c)
    return out


TABLE = _table()


def ngx_crc32_update(crc: int, data: bytes) -> int:
    """src/core/ngx_crc32.h: ``*crc = table[(c ^ *p++) & 0xff] ^ (c >> 8)``, no conditioning."""
    for b in data:
        crc = TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc


def ngx_crc32_long(data: bytes) -> int:
    return ngx_crc32_update(0xFFFFFFFF, data) ^ 0xFFFFFFFF  # init, update, final


def reference_points(host: bytes, port: bytes, weight: int) -> list[int]:
    """ngx_http_upstream_init_chash's loop, transcribed."""
    base = ngx_crc32_update(0xFFFFFFFF, host)
    base = ngx_crc32_update(base, b"\0")
    base = ngx_crc32_update(base, port)
    prev, out = 0, []
    for _ in range(160 * weight):
        h = ngx_crc32_update(base, struct.pack("<I", prev)) ^ 0xFFFFFFFF
        out.append(h)
        prev = h
    return out


def reference_ring(servers: list[tuple[str, int]]) -> list[tuple[int, str]]:
    """Sort (stable), drop later equal hashes."""
    pts = []
    for s, w in servers:
        host, port = s.rsplit(":", 1)
        pts += [(h, s) for h in reference_points(host.encode(), port.encode(), w)]
    pts.sort(key=lambda p: p[0])
    return [p for i, p in enumerate(pts) if i == 0 or pts[i - 1][0] != p[0]]


def reference_home(ring: list[tuple[int, str]], point: int) -> str:
    """The first point >= hash, wrapping to the first."""
    for h, s in ring:
        if h >= point:
            return s
    return ring[0][1]


def test_key_point_is_ngx_crc32_long() -> None:
    assert key_point("123456789") == 0xCBF43926  # the CRC-32 check value
    for key in ["s:abc", "u:alice", "p:" + "f" * 64, "", "s:é", "x" * 300]:
        assert key_point(key) == ngx_crc32_long(key.encode())
    assert key_point(b"s:abc") == key_point("s:abc")


@pytest.mark.parametrize("server,host,port", [
    ("127.0.0.1:8101", b"127.0.0.1", b"8101"),
    ("localhost:80", b"localhost", b"80"),
    ("backend", b"backend", b""),
    ("unix:/run/engine.sock", b"/run/engine.sock", b""),
    ("UNIX:/run/engine/x:1", b"/run/engine/x:1", b""),
    ("[::1]:8000", b"[::1]", b"8000"),
    ("host:8a", b"host:8a", b""),  # a non-digit after the last ':': no port
    ("host:", b"host", b""),
])
def test_split_server_like_nginx(server: str, host: bytes, port: bytes) -> None:
    assert split_server(server) == (host, port)


def test_server_points_match_the_c_loop() -> None:
    assert server_points("127.0.0.1:8101", 2) == reference_points(b"127.0.0.1", b"8101", 2)
    assert len(server_points("10.0.0.5:8000", 3)) == 480
    # raising a weight only appends points: the first 160 × w are the same
    assert server_points("10.0.0.5:8000", 5)[:480] == server_points("10.0.0.5:8000", 3)


def test_home_matches_reference_and_wraps() -> None:
    servers = [("127.0.0.1:9001", 2), ("127.0.0.1:9002", 1), ("127.0.0.1:9003", 3)]
    ring = Ring(servers)
    assert len(ring) == 960 and list(ring.hashes) == sorted(ring.hashes)
    ref = reference_ring(servers)
    assert list(ring.hashes) == [h for h, _ in ref]
    for i in range(300):
        p = key_point(f"s:{i}")
        assert ring.home(p) == reference_home(ref, p)
    first, last = ring.hashes[0], ring.hashes[-1]
    assert ring.home(first) == ring.owner(0)
    assert ring.home(first - 1 if first else 0) == ring.owner(0)
    assert ring.home(last) == ring.owner(len(ring) - 1)
    assert ring.home(last + 1) == ring.owner(0)  # past the last point: the first one
    assert ring.home(0xFFFFFFFF) == ring.owner(0) or last == 0xFFFFFFFF
    assert ring.home(ring.hashes[10] + 1) == ring.owner(11)


def test_walk_and_route() -> None:
    ring = Ring([("a:1", 1), ("b:1", 1), ("c:1", 1)], labels={"a:1": "a", "b:1": "b", "c:1": "c"}, down=["b"])
    for i in range(200):
        p = key_point(f"k{i}")
        order = list(ring.walk(p))
        assert sorted(order) == ["a", "b", "c"] and order[0] == ring.home(p)
        # down b is skipped: the next point's owner, i.e. the next server of the walk
        assert ring.route(p) == [n for n in order if n != "b"][0]
        assert ring.route(p, skip=["a"]) == [n for n in order if n not in ("a", "b")][0]
        assert ring.route(p, skip=["a", "c"]) is None  # nothing left: nginx uses round robin


def test_weights_give_proportional_shares() -> None:
    servers = [(f"127.0.0.1:{8101 + i}", w * 100) for i, w in enumerate([1, 2, 1, 3])]
    ring = Ring(servers)
    shares = ring.shares()
    assert abs(sum(shares.values()) - 1) < 1e-9
    for (s, w) in servers:
        assert abs(shares[s] - w / 700) < 0.01, shares
    counts = collections.Counter(ring.home(key_point(f"s:session-{i}")) for i in range(20000))
    for (s, w) in servers:
        assert abs(counts[s] / 20000 - w / 700) < 0.02, counts


def test_equal_hashes_keep_the_earlier_server() -> None:
    a, b = "127.0.0.1:8101", "127.0.0.1:8102"
    pa, pb = set(server_points(a, 1000)), set(server_points(b, 1000))
    both = sorted(pa & pb)
    if not both:  # pragma: no cover - these two strings do collide (checked when written)
        pytest.skip("no shared point")
    ab, ba = Ring([(a, 1000), (b, 1000)]), Ring([(b, 1000), (a, 1000)])
    assert len(ab) == len(pa | pb)
    for h in both:
        assert ab.home(h) == a and ba.home(h) == b


def test_ring_build_is_cached() -> None:
    servers = [("127.0.0.1:1", 100), ("127.0.0.1:2", 100)]
    assert Ring(servers).hashes is Ring(list(servers)).hashes
    with pytest.raises(ValueError):
        Ring([])
    with pytest.raises(ValueError):
        Ring([("127.0.0.1:1", 0)])


def test_pool_ring_uses_rendered_servers_and_weights() -> None:
    policy = parse_policy({"version": 1, "pools": [{
        "name": "p", "models": ["m"], "nodes": [
            {"id": "n1", "url": "http://127.0.0.1:9001", "weight": 2},
            {"id": "n2", "url": "http://localhost:9002/"},
            {"id": "n3", "url": "http://127.0.0.1:9003"},
        ]}]})
    ring = pool_ring(policy, "p", {"n3": 0, "n1": 150})
    assert ring.servers == (("127.0.0.1:9001", 150), ("localhost:9002", 100), ("127.0.0.1:9003", DOWN_WEIGHT))
    assert ring.down == {"n3"}
    assert set(ring.labels) == {"n1", "n2", "n3"}
    assert pool_ring(policy, "p").servers == (("127.0.0.1:9001", 200), ("localhost:9002", 100),
                                              ("127.0.0.1:9003", 100))
    with pytest.raises(KeyError):
        pool_ring(policy, "nope", {})
