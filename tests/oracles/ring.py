"""The consistent-hash ring of a ``chash`` pool, in Python: the executable spec and test
oracle of the gateway's ring (``lua/kvgate/balancer/ring.lua``). Test code only since issue
10 (was ``control/kvgate/ring.py``): the gateway logs each request's node and the key's home
node itself, so nothing in the shipped package rebuilds the ring.

A ``chash`` pool's upstream has a ``balancer_by_lua_block`` (``nginx/upstreams.conf.j2``)
whose ring ``kvgate.balancer.chash`` builds from ``kvgate.json`` in ``init_by_lua`` (the
master; workers inherit it by fork). This module
builds the same ring, so the tests can tell which node is a route key's *home*
(where its KV cache lives) without asking nginx; ``tests/data/ring_vectors.json`` holds
golden vectors both sides are checked against, and ``tests/integration/test_ring_nginx.py``
checks this ring against the real gateway.

The construction is nginx's ketama (``ngx_http_upstream_init_chash``, the ``hash ...
consistent`` of nginx 1.22, after Cache::Memcached::Fast), with one change: a point is
seeded from the node's **id**, where nginx uses the ``server`` line's ``HOST \\0 PORT``.
A node's place on the ring is therefore a function of its id and weight: giving it a new
address, writing its host as ``localhost`` on one gateway and ``127.0.0.1`` on another, or
listing the nodes in another order moves no key.

* Per node, ``base = crc32 state after id + b"\\0"`` (``ngx_crc32_init`` then
  ``ngx_crc32_update``, no final xor), ``prev = 0``; then ``160 × weight`` points, each
  ``hash = final(update(base, prev as 4 little-endian bytes))`` and ``prev = hash``. Since
  ``final(update(update(init, a), b))`` is the standard CRC-32 of ``a + b``, a point is
  ``zlib.crc32(id + b"\\0" + prev_le)``. Raising a weight only appends points, so keys
  move to that node and nowhere else.
* ``weight`` is in nginx ``weight=`` units (``kvgate.render.WEIGHT_SCALE`` per policy unit).
  A node that is down (weight 0 in force: draining, drained, ejected …) keeps
  :data:`DOWN_WEIGHT` (160 points, as nginx gives ``server ... down;``) and is skipped at
  lookup, so only its keys move. How many points it keeps does not change where they go:
  a skipped node's key lands on the first point of another node after the key's place,
  whatever the skipped node's points are.
* All points are sorted by hash; of a run of equal hashes only the first is kept, and the
  first is the point of the node whose id sorts first (bytewise, UTF-8). Collisions do
  happen: 4 nodes at ``weight=1000`` have 640,000 points and about 30 shared hashes.
* Lookup: the key's point is ``ngx_crc32_long(key)`` (standard CRC-32 of the key's bytes,
  :func:`key_point`, logged as ``point``); its home is the owner of the first point whose
  hash is ``>=`` it, wrapping past the last point to the first. :meth:`Ring.walk` gives the
  distinct nodes in ring order from there; :meth:`Ring.route` the first of them that is not
  down, failed or already tried (the gateway's failover goes to the next one), ``None`` when
  there is none (then the gateway answers 502).

The ring of the ``hash $kvgate_route_key consistent`` upstreams before this (points from the
``server`` strings, so keys moved with addresses) is gone; upgrading a gateway from it
remaps keys once (docs/gateway.md, Routing).
"""

from __future__ import annotations

import bisect
import functools
import struct
import zlib
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from kvgate.render import WEIGHT_SCALE

if TYPE_CHECKING:  # pragma: no cover
    from kvgate.policy.model import Policy

POINTS_PER_WEIGHT = 160
"""Ring points per unit of nginx ``weight=`` (nginx's ``npoints = peer->weight * 160``)."""

DOWN_WEIGHT = 1
"""The weight a down node keeps on the ring (nginx's default ``weight`` of a ``down`` server)."""

_LE32 = struct.Struct("<I")


def key_point(key: str | bytes) -> int:
    """The ring position of a route key: ``ngx_crc32_long(key)``, the standard CRC-32
    (``zlib.crc32``) of the key's bytes (UTF-8 for a ``str``) as an unsigned 32-bit int.

    The gateway writes this value to the request log as ``point`` (``ngx.crc32_long``).
    """
    data = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    return zlib.crc32(data) & 0xFFFFFFFF


def node_points(node_id: str, weight: int) -> list[int]:
    """The ``160 × weight`` point hashes of one node, in generation order."""
    base = zlib.crc32(node_id.encode("utf-8") + b"\0")
    out: list[int] = []
    prev = 0
    pack = _LE32.pack
    crc = zlib.crc32
    for _ in range(POINTS_PER_WEIGHT * int(weight)):
        prev = crc(pack(prev), base)
        out.append(prev)
    return out


@functools.lru_cache(maxsize=8)
def _build(nodes: tuple[tuple[str, int], ...]) -> tuple[array, array]:
    """(sorted distinct hashes, index into ``nodes`` of each point's owner) as compact arrays
    (4 bytes + 2 bytes a point: 4 nodes at ``weight=1000`` are 640,000 points, ~4 MB);
    ``nodes`` sorted by id.

    Cached for the last few weight sets only: every ramp step or weight change is a new
    ring, and an unbounded cache of them would grow without end."""
    if len(nodes) > 0xFFFF:
        raise ValueError("more than 65535 nodes in one pool")
    packed: list[int] = []
    for idx, (node_id, weight) in enumerate(nodes):
        packed.extend((h << 16) | idx for h in node_points(node_id, weight))
    # (hash, index) packed in one int: of equal hashes the lower index (lower id) sorts first
    packed.sort()
    hashes = array("I")
    owners = array("H")
    last = -1
    for v in packed:
        h = v >> 16
        if h == last:
            continue  # the first point of a run of equal hashes is kept
        hashes.append(h)
        owners.append(v & 0xFFFF)
        last = h
    return hashes, owners


def _id_order(node_id: str) -> bytes:
    return node_id.encode("utf-8")


class Ring:
    """The ketama ring of one pool, points from node ids.

    Args:
        nodes: ``(node id, weight)`` per node, in any order (the ring sorts them by id).
            ``weight`` in nginx ``weight=`` units, ``>= 1``; a down node is listed with
            :data:`DOWN_WEIGHT` and named in ``down``.
        down: ids of nodes that own points but are skipped (draining, drained, ejected …).

    Raises:
        ValueError: no node, a weight below 1, or an id listed twice.

    Building is cached per node set (:func:`functools.lru_cache`), so making a ``Ring`` for
    the same pool and weights again is cheap.
    """

    def __init__(self, nodes: Iterable[tuple[str, int]], *, down: Iterable[str] = ()) -> None:
        self.nodes: tuple[tuple[str, int], ...] = tuple(
            sorted(((str(i), int(w)) for i, w in nodes), key=lambda n: _id_order(n[0])))
        if not self.nodes:
            raise ValueError("a ring needs at least one node")
        for (i, w), nxt in zip(self.nodes, self.nodes[1:] + (("", 1),)):
            if w < 1:
                raise ValueError(f"node {i!r}: weights are >= 1 (a down node has weight {DOWN_WEIGHT})")
            if i == nxt[0]:
                raise ValueError(f"node id {i!r} appears twice")
        self.ids: tuple[str, ...] = tuple(i for i, _ in self.nodes)
        self.down: frozenset[str] = frozenset(down)
        self._hashes, self._owners = _build(self.nodes)

    def __len__(self) -> int:
        """Number of distinct points (after equal hashes are collapsed)."""
        return len(self._hashes)

    @property
    def hashes(self) -> Sequence[int]:
        """The sorted distinct point hashes."""
        return self._hashes

    def index(self, point: int) -> int:
        """Index of the first ring point with hash ``>= point``, wrapping to 0."""
        i = bisect.bisect_left(self._hashes, int(point) & 0xFFFFFFFF)
        return 0 if i == len(self._hashes) else i

    def owner(self, index: int) -> str:
        """Id of the node that owns ring point number ``index`` (modulo the ring size)."""
        return self.ids[self._owners[index % len(self._owners)]]

    def home(self, point: int) -> str:
        """The node owning the first point at or after ``point``: where the gateway sends
        the key when that node is up, has not failed and was not tried."""
        return self.owner(self.index(point))

    def walk(self, point: int) -> Iterator[str]:
        """Distinct nodes in ring order from the key's home: the order the gateway tries
        them in when earlier ones are down, failed or already tried (down ones included)."""
        seen: set[str] = set()
        distinct = len(self.ids)
        start = self.index(point)
        for k in range(len(self._owners)):
            node = self.owner(start + k)
            if node not in seen:
                seen.add(node)
                yield node
                if len(seen) == distinct:
                    return

    def route(self, point: int, skip: Iterable[str] = ()) -> str | None:
        """Where the gateway sends the key when the nodes in :attr:`down` and in ``skip``
        (failed or tried) are unavailable: the first other node of :meth:`walk`; ``None``
        when every node is unavailable."""
        unavailable = self.down | frozenset(skip)
        return next((n for n in self.walk(point) if n not in unavailable), None)

    def shares(self) -> dict[str, float]:
        """Fraction of the 32-bit hash space each node is home for (its keys' share for
        uniformly spread keys)."""
        out = {node: 0.0 for node in self.ids}
        hashes, owners = self._hashes, self._owners
        total = float(1 << 32)
        prev = hashes[-1] - (1 << 32)  # the wrap-around arc belongs to the first point
        for h, idx in zip(hashes, owners):
            out[self.ids[idx]] += (h - prev) / total
            prev = h
        return out


def pool_ring(policy: Policy, pool_name: str, weights: Mapping[str, int] | None = None) -> Ring:
    """The ring the gateway builds for ``pool_name`` from the ``kvgate.json`` that
    :mod:`kvgate.render` writes for ``policy`` and ``weights``.

    Args:
        policy: the policy in force.
        pool_name: a pool of ``policy``.
        weights: node id → nginx ``weight=`` in force (the control plane's
            ``plane.applied.weights``); a node not in the map gets ``base weight ×
            WEIGHT_SCALE`` (as :class:`kvgate.render.Runtime` does); ``0`` means down: the
            node keeps :data:`DOWN_WEIGHT` (160 points) and is in :attr:`Ring.down`.

    Raises:
        KeyError: no pool of that name.
    """
    pool = next((p for p in policy.pools if p.name == pool_name), None)
    if pool is None:
        raise KeyError(pool_name)
    weights = weights or {}
    nodes: list[tuple[str, int]] = []
    down: list[str] = []
    for node in pool.nodes:
        w = int(weights.get(node.id, node.weight * WEIGHT_SCALE))
        if w <= 0:
            w = DOWN_WEIGHT
            down.append(node.id)
        nodes.append((node.id, w))
    return Ring(nodes, down=down)
