"""nginx's consistent-hash ring (``hash $kvgate_route_key consistent``), in Python.

A ``chash`` pool is rendered as ``upstream pool_<name> { hash $kvgate_route_key consistent;
server HOST:PORT weight=W ...; }`` (``nginx/upstreams.conf.j2``). This module rebuilds the
ring nginx builds from that block, so the control plane can tell which node is a route
key's *home* (where its KV cache lives) without asking nginx.

The algorithm is nginx's ``ngx_http_upstream_init_chash`` and
``ngx_http_upstream_find_chash_point`` (``src/http/modules/ngx_http_upstream_hash_module.c``,
read for nginx 1.22, the Debian 12 package), which follows the ketama scheme of
Cache::Memcached::Fast ("crc32(HOST \\0 PORT PREV_HASH)"):

* For every server, in the order of the ``server`` lines, the ``server`` string as written
  (``127.0.0.1:8101``) is split into HOST and PORT at its last ``:`` *only if* everything
  after that ``:`` is digits (``ngx_http_upstream_init_chash`` scans back from the end and
  stops at the first non-digit); otherwise HOST is the whole string and PORT is empty. A
  ``unix:`` server (prefix matched case-insensitively) has HOST = the path after ``unix:``
  and an empty PORT.
* ``base = crc32 state after HOST + b"\\0" + PORT`` (``ngx_crc32_init`` then
  ``ngx_crc32_update``: no final xor in between), ``prev = 0``; then ``160 × weight``
  points, each ``hash = final(update(base, prev as 4 little-endian bytes))`` and
  ``prev = hash``. ``ngx_crc32_update`` is the plain table CRC-32 without pre/post
  conditioning, ``ngx_crc32_init`` sets ``0xffffffff`` and ``ngx_crc32_final`` xors it
  again, so ``final(update(update(init, a), b))`` is the standard CRC-32 of ``a + b``:
  ``zlib.crc32(HOST + b"\\0" + PORT + prev_le)``. (``zlib.crc32(b, zlib.crc32(a))`` is the
  same value: zlib undoes its final xor when it continues.)
* A server marked ``down`` keeps its points: nginx parses ``server ... down;`` with the
  default ``weight=1``, so it has 160 points (not 160 × its usual weight), and
  ``ngx_http_upstream_get_chash_peer`` skips it at lookup time, walking on to the next
  point. ``weight=0`` is not valid nginx; ``kvgate.render`` writes ``down`` instead.
* All points are sorted by hash with ``ngx_qsort`` (libc ``qsort``), then **runs of equal
  hashes are collapsed to their first point** (``if (points->point[i].hash !=
  points->point[j].hash) points->point[++i] = points->point[j]``). Which server's point
  comes first in such a run depends on the sort's stability: Debian 12's glibc 2.36
  ``qsort`` is a merge sort (stable) for these 16-byte elements, so the point generated
  first wins, i.e. the server written earlier in the upstream block. Python's sort is
  stable too, so this module keeps the same one (``tests/integration/test_ring_nginx.py``
  checks it against nginx on keys crafted to land on shared hashes). A libc with an
  unstable ``qsort`` (e.g. musl's smoothsort) may keep the other server there. Collisions
  do happen: a pool of 4 nodes at ``weight=100`` has 64,000 points, about half a colliding
  pair expected; 4 at ``weight=1000`` have about 30.
* Lookup: ``ngx_crc32_long(key)`` (standard CRC-32 of the key bytes, :func:`key_point`);
  the first point whose hash is ``>=`` it, wrapping past the last point to the first
  (``hp->hash % points->number``). If that server is down, has failed
  (``max_fails``/``fail_timeout``) or was already tried, nginx moves to the next point
  (``hp->hash++``), at most 20 times; after that, and for an empty key or a single
  server, it falls back to weighted round robin.

A host name in a ``server`` line that resolves to several addresses gives several peers
with the same ``server`` string: their points are identical and collapse into one set, so
the ring is a function of the ``server`` strings and weights only.
"""

from __future__ import annotations

import bisect
import functools
import struct
import zlib
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from .render import WEIGHT_SCALE

if TYPE_CHECKING:  # pragma: no cover
    from .policy.model import Policy

POINTS_PER_WEIGHT = 160
"""Ring points per unit of nginx ``weight=`` (``npoints = peer->weight * 160``)."""

MAX_TRIES = 20
"""``ngx_http_upstream_get_chash_peer`` gives up on the ring after this many extra points
(``hp->tries > 20``) and falls back to round robin."""

DOWN_WEIGHT = 1
"""The weight nginx gives a ``server ... down;`` line (its default ``weight``)."""

_LE32 = struct.Struct("<I")


def key_point(key: str | bytes) -> int:
    """The ring position of a route key: ``ngx_crc32_long(key)``, the standard CRC-32
    (``zlib.crc32``) of the key's bytes (UTF-8 for a ``str``) as an unsigned 32-bit int.

    The gateway writes this value to the request log as ``point`` (``ngx.crc32_long``).
    """
    data = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    return zlib.crc32(data) & 0xFFFFFFFF


def split_server(server: str) -> tuple[bytes, bytes]:
    """HOST and PORT bytes of a ``server`` string the way ``ngx_http_upstream_init_chash``
    splits it (see the module docstring): ``"127.0.0.1:8101"`` → ``(b"127.0.0.1", b"8101")``,
    ``"unix:/run/x.sock"`` → ``(b"/run/x.sock", b"")``, ``"backend"`` → ``(b"backend", b"")``."""
    data = server.encode("utf-8")
    if len(data) >= 5 and data[:5].lower() == b"unix:":
        return data[5:], b""
    for j in range(len(data)):
        c = data[len(data) - j - 1]
        if c == 0x3A:  # ':'
            return data[: len(data) - j - 1], data[len(data) - j:]
        if not 0x30 <= c <= 0x39:
            break
    return data, b""


def server_points(server: str, weight: int) -> list[int]:
    """The ``160 × weight`` point hashes nginx generates for one server, in generation order."""
    host, port = split_server(server)
    base = zlib.crc32(host + b"\0" + port)
    out: list[int] = []
    prev = 0
    pack = _LE32.pack
    crc = zlib.crc32
    for _ in range(POINTS_PER_WEIGHT * int(weight)):
        prev = crc(pack(prev), base)
        out.append(prev)
    return out


@functools.lru_cache(maxsize=8)
def _build(servers: tuple[tuple[str, int], ...]) -> tuple[array, array]:
    """(sorted distinct hashes, index into ``servers`` of each point's owner) as compact
    arrays (4 bytes + 2 bytes a point: 4 servers at ``weight=1000`` are 640,000 points, ~4 MB).

    Cached for the last few weight sets only: every ramp step or weight change is a new
    ring, and an unbounded cache of them would grow without end."""
    if len(servers) > 0xFFFF:
        raise ValueError("more than 65535 servers in one upstream")
    packed: list[int] = []
    for idx, (server, weight) in enumerate(servers):
        packed.extend((h << 16) | idx for h in server_points(server, weight))
    # sorting (hash, server index) packed in one int: for equal hashes the earlier server's
    # point comes first, as nginx's sort leaves it (its points were generated first)
    packed.sort()
    hashes = array("I")
    owners = array("H")
    last = -1
    for v in packed:
        h = v >> 16
        if h == last:
            continue  # nginx keeps the first point of a run of equal hashes
        hashes.append(h)
        owners.append(v & 0xFFFF)
        last = h
    return hashes, owners


class Ring:
    """nginx's ketama ring for one upstream block.

    Args:
        servers: ``(server string, nginx weight)`` per ``server`` line, in the upstream's
            order (the order matters only for equal point hashes). A down server is listed
            with the weight nginx gives it (:data:`DOWN_WEIGHT`) and named in ``down``.
        labels: server string → the name :meth:`home` and friends return (e.g. node ids);
            a server not in the map is returned as its server string.
        down: labels of the servers marked ``down``: they own points but nginx skips them.

    Building is cached per ``servers`` tuple (:func:`functools.lru_cache`), so making a
    ``Ring`` for the same upstream again is cheap.
    """

    def __init__(self, servers: Iterable[tuple[str, int]], *, labels: Mapping[str, str] | None = None,
                 down: Iterable[str] = ()) -> None:
        self.servers: tuple[tuple[str, int], ...] = tuple((str(s), int(w)) for s, w in servers)
        if not self.servers:
            raise ValueError("a ring needs at least one server")
        for s, w in self.servers:
            if w < 1:
                raise ValueError(f"server {s!r}: nginx weights are >= 1 (a down server has weight {DOWN_WEIGHT})")
        self.labels: tuple[str, ...] = tuple((labels or {}).get(s, s) for s, _ in self.servers)
        self.down: frozenset[str] = frozenset(down)
        self._hashes, self._owners = _build(self.servers)

    def __len__(self) -> int:
        """Number of distinct points (after equal hashes are collapsed)."""
        return len(self._hashes)

    @property
    def hashes(self) -> Sequence[int]:
        """The sorted distinct point hashes."""
        return self._hashes

    def index(self, point: int) -> int:
        """Index of the first ring point with hash ``>= point``, wrapping to 0
        (``ngx_http_upstream_find_chash_point`` then ``% points->number``)."""
        i = bisect.bisect_left(self._hashes, int(point) & 0xFFFFFFFF)
        return 0 if i == len(self._hashes) else i

    def owner(self, index: int) -> str:
        """Label of the server that owns ring point number ``index`` (modulo the ring size)."""
        return self.labels[self._owners[index % len(self._owners)]]

    def home(self, point: int) -> str:
        """The server owning the first point at or after ``point``: where nginx sends the
        key when that server is up and has not failed (down or not)."""
        return self.owner(self.index(point))

    def walk(self, point: int) -> Iterator[str]:
        """Distinct servers in ring order from the key's home: the order nginx tries them
        in when earlier ones are down, failed or already tried (down ones included)."""
        seen: set[str] = set()
        distinct = len(set(self.labels))
        start = self.index(point)
        for k in range(len(self._owners)):
            label = self.owner(start + k)
            if label not in seen:
                seen.add(label)
                yield label
                if len(seen) == distinct:
                    return

    def route(self, point: int, skip: Iterable[str] = ()) -> str | None:
        """Where nginx sends the key when the servers in :attr:`down` and in ``skip``
        (failed or tried) are unavailable: the owner of the first of at most
        ``MAX_TRIES + 1`` points from the home point that is available; ``None`` when
        those points are all unavailable (nginx then falls back to round robin)."""
        unavailable = self.down | frozenset(skip)
        start = self.index(point)
        for k in range(MAX_TRIES + 1):
            label = self.owner(start + k)
            if label not in unavailable:
                return label
        return None

    def shares(self) -> dict[str, float]:
        """Fraction of the 32-bit hash space each server is home for (its keys' share
        for uniformly spread keys)."""
        out = {label: 0.0 for label in self.labels}
        hashes, owners = self._hashes, self._owners
        total = float(1 << 32)
        prev = hashes[-1] - (1 << 32)  # the wrap-around arc belongs to the first point
        for h, idx in zip(hashes, owners):
            out[self.labels[idx]] += (h - prev) / total
            prev = h
        return out


def pool_ring(policy: Policy, pool_name: str, weights: Mapping[str, int] | None = None) -> Ring:
    """The ring nginx builds for ``upstream pool_<pool_name>`` as :mod:`kvgate.render`
    writes it, labelled with node ids.

    Args:
        policy: the policy in force.
        pool_name: a pool of ``policy``.
        weights: node id → nginx ``weight=`` in force (the control plane's
            ``plane.applied.weights``); a node not in the map gets ``base weight ×
            WEIGHT_SCALE`` (as :class:`kvgate.render.Runtime` does); ``0`` means rendered
            ``down``: the server keeps :data:`DOWN_WEIGHT` (160 points) and is in
            :attr:`Ring.down`.

    Raises:
        KeyError: no pool of that name.
    """
    pool = next((p for p in policy.pools if p.name == pool_name), None)
    if pool is None:
        raise KeyError(pool_name)
    weights = weights or {}
    servers: list[tuple[str, int]] = []
    labels: dict[str, str] = {}
    down: list[str] = []
    for node in pool.nodes:
        w = int(weights.get(node.id, node.weight * WEIGHT_SCALE))
        if w <= 0:
            w = DOWN_WEIGHT
            down.append(node.id)
        # the exact string upstreams.conf.j2 writes after `server`
        servers.append((node.address, w))
        labels[node.address] = node.id
    return Ring(servers, labels=labels, down=down)
