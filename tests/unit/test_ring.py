"""tests/oracles/ring.py, the oracle of the gateway's ring (lua/kvgate/balancer/ring.lua): points from
node ids, checked against an independent CRC-32 written the way nginx's
ngx_crc32_init/update/final are, against golden vectors (tests/data/ring_vectors.json, which
tests/lua/test_ring.lua checks the Lua ring against too) and against the Lua ring itself on
100,000 random keys. tests/integration/test_ring_nginx.py checks it against the gateway.

Regenerate the vectors after a deliberate change of the ring (which remaps keys on every
gateway: say so in docs/gateway.md) with ``python tests/unit/test_ring.py``."""

from __future__ import annotations

import collections
import json
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

if __name__ == "__main__":  # run as a script: tests/ for the oracles (pytest: pyproject's pythonpath)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgate.policy.loader import parse_policy
from oracles.ring import DOWN_WEIGHT, Ring, key_point, node_points, pool_ring

REPO = Path(__file__).resolve().parents[2]
VECTORS = REPO / "tests" / "data" / "ring_vectors.json"


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


def reference_points(node_id: bytes, weight: int) -> list[int]:
    """ngx_http_upstream_init_chash's loop, transcribed, with the id where nginx has HOST
    and an empty PORT."""
    base = ngx_crc32_update(0xFFFFFFFF, node_id)
    base = ngx_crc32_update(base, b"\0")
    prev, out = 0, []
    for _ in range(160 * weight):
        h = ngx_crc32_update(base, struct.pack("<I", prev)) ^ 0xFFFFFFFF
        out.append(h)
        prev = h
    return out


def reference_ring(nodes: list[tuple[str, int]]) -> list[tuple[int, str]]:
    """Nodes by id, sort (stable), drop later equal hashes."""
    pts = []
    for i, w in sorted(nodes):
        pts += [(h, i) for h in reference_points(i.encode(), w)]
    pts.sort(key=lambda p: p[0])
    return [p for i, p in enumerate(pts) if i == 0 or pts[i - 1][0] != p[0]]


def reference_home(ring: list[tuple[int, str]], point: int) -> str:
    """The first point >= hash, wrapping to the first."""
    for h, s in ring:
        if h >= point:
            return s
    return ring[0][1]


# ---------------------------------------------------------------- golden vectors
GOLDEN_RINGS: list[dict[str, Any]] = [
    {"name": "weighted", "nodes": [["n1", 100], ["n2", 200], ["n3", 100], ["n4", 300]], "down": []},
    {"name": "unweighted", "nodes": [["gpu-a", 100], ["gpu-b", 100], ["gpu-c", 100]], "down": []},
    {"name": "partly-down", "nodes": [["n1", 100], ["n2", DOWN_WEIGHT], ["n3", 150], ["n4", 100]], "down": ["n2"]},
    {"name": "one-node", "nodes": [["solo", 100]], "down": []},
]


def golden_vectors() -> dict[str, Any]:
    """The vectors as the oracle computes them (what tests/data/ring_vectors.json must hold)."""
    points = []
    for node_id, weight in [("n1", 1), ("n2", 2), ("gpu-a", 1), ("x", 3)]:
        pts = node_points(node_id, weight)
        points.append({"id": node_id, "weight": weight, "count": len(pts), "first": pts[:4], "last": pts[-1]})
    rings = []
    for spec in GOLDEN_RINGS:
        ring = Ring([tuple(n) for n in spec["nodes"]], down=spec["down"])
        keys = [f"s:session-{i}" for i in range(40)] + ["u:alice", "p:" + "f" * 64, "s:é"]
        edges = [0, 0xFFFFFFFF, ring.hashes[0], ring.hashes[-1], ring.hashes[-1] + 1, ring.hashes[7] + 1]
        cases = [{"key": k, "point": key_point(k)} for k in keys] + [{"point": p & 0xFFFFFFFF} for p in edges]
        for c in cases:
            walk = list(ring.walk(c["point"]))
            c.update(home=walk[0], walk=walk, route=ring.route(c["point"]),
                     route_skip_home=ring.route(c["point"], skip=[walk[0]]))
        rings.append({**spec, "size": len(ring), "first": list(ring.hashes[:3]), "last": ring.hashes[-1],
                      "cases": cases})
    return {"about": "golden vectors of kvgate's chash ring (tests/unit/test_ring.py writes them from "
                     "tests/oracles/ring.py; tests/lua/test_ring.lua checks lua/kvgate/balancer/ring.lua)",
            "points": points, "rings": rings}


def test_golden_vectors_are_the_oracles() -> None:
    assert json.loads(VECTORS.read_text()) == golden_vectors(), \
        "the ring changed: every key remaps; if deliberate, regenerate (see the module docstring)"


# ---------------------------------------------------------------- the construction
def test_key_point_is_ngx_crc32_long() -> None:
    assert key_point("123456789") == 0xCBF43926  # the CRC-32 check value
    for key in ["s:abc", "u:alice", "p:" + "f" * 64, "", "s:é", "x" * 300]:
        assert key_point(key) == ngx_crc32_long(key.encode())
    assert key_point(b"s:abc") == key_point("s:abc")


def test_node_points_match_the_c_loop_seeded_by_the_id() -> None:
    assert node_points("n1", 2) == reference_points(b"n1", 2)
    assert len(node_points("gpu-7", 3)) == 480
    # raising a weight only appends points: the first 160 × w are the same
    assert node_points("gpu-7", 5)[:480] == node_points("gpu-7", 3)
    # nothing of an address goes in: ids alone
    assert node_points("n1", 1) != node_points("n2", 1)


def test_home_matches_reference_and_wraps() -> None:
    nodes = [("n1", 2), ("n2", 1), ("n3", 3)]
    ring = Ring(nodes)
    assert len(ring) == 960 and list(ring.hashes) == sorted(ring.hashes)
    ref = reference_ring(nodes)
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


def test_the_order_of_the_nodes_does_not_matter() -> None:
    nodes = [("n1", 100), ("n2", 300), ("n3", 100)]
    a, b = Ring(nodes), Ring(list(reversed(nodes)))
    assert a.nodes == b.nodes and list(a.hashes) == list(b.hashes)
    assert all(a.home(key_point(f"k{i}")) == b.home(key_point(f"k{i}")) for i in range(2000))


def test_walk_and_route() -> None:
    ring = Ring([("a", 1), ("b", 1), ("c", 1)], down=["b"])
    for i in range(200):
        p = key_point(f"k{i}")
        order = list(ring.walk(p))
        assert sorted(order) == ["a", "b", "c"] and order[0] == ring.home(p)
        # down b is skipped: the next node of the walk
        assert ring.route(p) == [n for n in order if n != "b"][0]
        assert ring.route(p, skip=["a"]) == [n for n in order if n not in ("a", "b")][0]
        assert ring.route(p, skip=["a", "c"]) is None  # nothing left: the gateway answers 502


def test_weights_give_proportional_shares() -> None:
    nodes = [(f"n{i}", w * 100) for i, w in enumerate([1, 2, 1, 3])]
    ring = Ring(nodes)
    shares = ring.shares()
    assert abs(sum(shares.values()) - 1) < 1e-9
    for (n, w) in nodes:
        assert abs(shares[n] - w / 700) < 0.01, shares
    counts = collections.Counter(ring.home(key_point(f"s:session-{i}")) for i in range(20000))
    for (n, w) in nodes:
        assert abs(counts[n] / 20000 - w / 700) < 0.02, counts


def test_keys_move_only_to_or_from_the_changed_node() -> None:
    base = [("n1", 100), ("n2", 100), ("n3", 100), ("n4", 100)]
    points = [key_point(f"s:{i}") for i in range(5000)]
    ring = Ring(base)
    heavier = Ring([("n1", 100), ("n2", 250), ("n3", 100), ("n4", 100)])
    without = Ring([("n1", 100), ("n3", 100), ("n4", 100)])
    down = Ring([("n1", 100), ("n2", DOWN_WEIGHT), ("n3", 100), ("n4", 100)], down=["n2"])
    for p in points:
        home = ring.home(p)
        assert heavier.home(p) in (home, "n2")  # a weight raised: keys move to it only
        if home != "n2":
            assert without.home(p) == home and down.route(p) == home  # others' keys stay
        else:
            # removed or down: n2's keys go to the next node of their walk, the same either way
            assert without.home(p) == down.route(p) == ring.route(p, skip=["n2"])


def test_equal_hashes_keep_the_lowest_id() -> None:
    a, b = "n1", "n2"
    pa, pb = set(node_points(a, 1000)), set(node_points(b, 1000))
    both = sorted(pa & pb)
    if not both:  # pragma: no cover - these two ids do collide (checked when written)
        pytest.skip("no shared point")
    ab, ba = Ring([(a, 1000), (b, 1000)]), Ring([(b, 1000), (a, 1000)])
    assert len(ab) == len(pa | pb)
    for h in both:
        assert ab.home(h) == a and ba.home(h) == a


def test_ring_build_is_cached_and_checked() -> None:
    nodes = [("a", 100), ("b", 100)]
    assert Ring(nodes).hashes is Ring(list(nodes)).hashes
    with pytest.raises(ValueError):
        Ring([])
    with pytest.raises(ValueError):
        Ring([("a", 0)])
    with pytest.raises(ValueError, match="twice"):
        Ring([("a", 1), ("a", 2)])


def test_pool_ring_uses_ids_and_weights_not_addresses() -> None:
    def policy(urls: list[str]):
        return parse_policy({"version": 1, "pools": [{
            "name": "p", "models": ["m"], "nodes": [
                {"id": "n1", "url": urls[0], "weight": 2},
                {"id": "n2", "url": urls[1]},
                {"id": "n3", "url": urls[2]},
            ]}]})

    a = policy(["http://127.0.0.1:9001", "http://localhost:9002/", "http://127.0.0.1:9003"])
    b = policy(["http://10.0.0.7:8000", "http://127.0.0.1:9002", "http://gpu3.internal:9"])
    ring = pool_ring(a, "p", {"n3": 0, "n1": 150})
    assert ring.nodes == (("n1", 150), ("n2", 100), ("n3", DOWN_WEIGHT))
    assert ring.down == {"n3"} and ring.ids == ("n1", "n2", "n3")
    assert pool_ring(a, "p").nodes == (("n1", 200), ("n2", 100), ("n3", 100))
    assert list(pool_ring(a, "p").hashes) == list(pool_ring(b, "p").hashes)
    with pytest.raises(KeyError):
        pool_ring(a, "nope", {})


# ---------------------------------------------------------------- the Lua ring, 100,000 keys
AGREEMENT_POOLS: list[tuple[str, list[tuple[str, int]], list[str]]] = [
    ("weighted", [("n1", 100), ("n2", 200), ("n3", 100), ("n4", 300), ("n5", 1000)], []),
    ("unweighted", [(f"node-{i}", 100) for i in range(6)], []),
    ("partly-down", [("n1", 100), ("n2", DOWN_WEIGHT), ("n3", 300), ("n4", DOWN_WEIGHT), ("n5", 100)], ["n2", "n4"]),
]


def test_lua_ring_maps_100000_random_keys_as_the_oracle(tmp_path: Path) -> None:
    luajit = shutil.which("luajit")
    assert luajit, "luajit is not installed (apt-get install luajit2)"
    rng = random.Random(20260509)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_:./"
    keys = ["spu"[i % 3] + ":" + "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 48)))
            for i in range(100_000)]
    (tmp_path / "keys.txt").write_text("\n".join(keys) + "\n")
    for name, nodes, down in AGREEMENT_POOLS:
        spec = tmp_path / f"{name}.json"
        spec.write_text(json.dumps({"nodes": nodes, "down": down, "keys": str(tmp_path / "keys.txt")}))
        res = subprocess.run([luajit, "tests/lua/ring_map.lua", str(spec)], cwd=REPO, capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        got = res.stdout.splitlines()
        ring = Ring(nodes, down=down)
        want = [f"{key_point(k)} {ring.home(key_point(k))} {ring.route(key_point(k))}" for k in keys]
        assert len(got) == len(want)
        wrong = [(k, g, w) for k, g, w in zip(keys, got, want) if g != w]
        assert not wrong, f"{name}: {len(wrong)} of {len(keys)} keys differ, e.g. {wrong[:3]}"


if __name__ == "__main__":  # regenerate the golden vectors
    VECTORS.parent.mkdir(parents=True, exist_ok=True)
    VECTORS.write_text(json.dumps(golden_vectors(), indent=1) + "\n")
    print(f"wrote {VECTORS}", file=sys.stderr)
