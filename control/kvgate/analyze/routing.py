"""Where the gateway sends a request, offline: its route key and the chash ring's home.

Two pieces of the gateway, re-stated in Python for ``kvgate analyze`` (the shipped package
has no ring of its own since issue 10; ``tests/oracles/ring.py`` is the test oracle, and
``tests/unit/test_analyze_routing.py`` checks this module against it and against the Lua
route key):

* :func:`route_key` — ``lua/kvgate/route_key.lua``'s ``compute`` for a chat request: the
  pool's ``affinity`` sources in order; ``session`` (the session header's value, trimmed) →
  ``"s:" + value``; ``user`` (the body's ``user``) → ``"u:" + user``; ``prefix`` →
  ``"p:" + sha256 hex`` of the first ``prefix_chars`` **bytes** of the canonical prompt
  (``lua/kvgate/prompt.lua``: per message ``RS role US content``, escaped), cut at the end of
  the first user message's text when that comes first. Placeholder ids ("null", "undefined",
  "", ...) count as absent, as the gateway's ``sentinel()`` does for the common ones.
* :class:`Ring` — the ketama ring of ``lua/kvgate/balancer/ring.lua``: per node ``160 ×
  weight`` points, ``crc32(id + b"\\0" + prev as 4 LE bytes)``, sorted, of equal hashes the
  lowest id's kept; a key's point is ``crc32(key)``; its home the owner of the first point
  ``>=`` it, wrapping. Weights in nginx ``weight=`` units (policy weight ×
  ``kvgate.render.WEIGHT_SCALE``).
"""

from __future__ import annotations

import bisect
import hashlib
import struct
import zlib
from collections.abc import Iterator, Sequence

POINTS_PER_WEIGHT = 160
RS, US = "\x1e", "\x1f"
_ESC = {"\\": "\\\\", RS: "\\x1e", US: "\\x1f"}
_SENTINELS = {"null", "undefined", "none", "nil", "<nil>", "nan", "(null)", "nullptr", '"null"',
              '"undefined"', "[object object]"}
_LE32 = struct.Struct("<I")


def _esc(s: str) -> str:
    if "\\" not in s and RS not in s and US not in s:
        return s
    return "".join(_ESC.get(c, c) for c in s)


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p if isinstance(p, str) else p["text"] for p in content
                       if isinstance(p, str) or (isinstance(p, dict) and p.get("type") == "text"
                                                 and isinstance(p.get("text"), str)))
    return ""


def prefix_window(messages: Sequence[dict], prefix_chars: int) -> tuple[bytes, bool]:
    """The fingerprinted window of a chat prompt (UTF-8 bytes) and its ``shared`` flag.

    ``shared`` is the route stage's flag: the window ended before any text of the first user
    message, so it covers only the system prompt (many conversations' key). Tools are not
    read (the trace has none; a request with ``tools`` puts ``"T" US json`` first).
    """
    out = bytearray()
    first_user_start = first_user_end = None
    for m in messages:
        if not isinstance(m, dict):
            continue
        role = m.get("role") if isinstance(m.get("role"), str) else ""
        head = (RS + _esc(role) + US).encode("utf-8")
        body = _esc(_content_text(m.get("content"))).encode("utf-8")
        if role == "user" and first_user_end is None:
            first_user_start = len(out) + len(head)
            first_user_end = first_user_start + len(body)
        out += head
        out += body
        if len(out) >= prefix_chars and first_user_end is not None:
            break
    n = prefix_chars if first_user_end is None else min(prefix_chars, first_user_end)
    window = bytes(out[:n])
    shared = (first_user_start is not None and len(window) <= first_user_start
              and first_user_end > first_user_start)
    return window, shared


def _sentinel(v: str) -> bool:
    t = v.strip()
    return t == "" or t.lower() in _SENTINELS


def route_key(messages: Sequence[dict], *, affinity: Sequence[str], prefix_chars: int,
              session: str | None = None, user: object = None,
              fallback: str = "") -> tuple[str, str, bool]:
    """``(key, kind, shared)`` as the gateway computes them for a chat request.

    Args:
        messages: the request's chat messages.
        affinity: the pool's sources, in order (``session``, ``user``, ``prefix``).
        prefix_chars: the pool's window in bytes.
        session: the session header's value (None: no header).
        user: the body's ``user`` field.
        fallback: the gateway's ``fallback_route_key`` (kind ``fallback``).
    """
    for src in affinity:
        if src == "session" and isinstance(session, str) and not _sentinel(session.strip(" \t")):
            return "s:" + session.strip(" \t"), "session", False
        if src == "user" and isinstance(user, str) and not _sentinel(user):
            return "u:" + user, "user", False
        if src == "prefix":
            window, shared = prefix_window(messages, prefix_chars)
            if window:
                return "p:" + hashlib.sha256(window).hexdigest(), "prefix", shared
    return fallback, "fallback", False


def key_point(key: str) -> int:
    """``ngx.crc32_long(key)``: the key's place on the ring."""
    return zlib.crc32(key.encode("utf-8")) & 0xFFFFFFFF


class Ring:
    """The gateway's ketama ring for nodes ``(id, weight)`` (weights in nginx units, ≥ 1)."""

    def __init__(self, nodes: Sequence[tuple[str, int]]):
        self.ids = tuple(sorted((str(i) for i, _ in nodes), key=lambda s: s.encode("utf-8")))
        weight = {str(i): int(w) for i, w in nodes}
        if not self.ids or len(weight) != len(self.ids):
            raise ValueError("a ring needs distinct node ids")
        packed: list[int] = []
        for idx, node_id in enumerate(self.ids):
            base = zlib.crc32(node_id.encode("utf-8") + b"\0")
            prev = 0
            for _ in range(POINTS_PER_WEIGHT * weight[node_id]):
                prev = zlib.crc32(_LE32.pack(prev), base)
                packed.append((prev << 16) | idx)
        packed.sort()
        self._hashes: list[int] = []
        self._owners: list[int] = []
        last = -1
        for v in packed:
            h = v >> 16
            if h != last:
                self._hashes.append(h)
                self._owners.append(v & 0xFFFF)
                last = h

    def _index(self, point: int) -> int:
        i = bisect.bisect_left(self._hashes, point)
        return 0 if i == len(self._hashes) else i

    def home(self, point: int) -> str:
        """The node owning the first point ``>= point`` (wrapping)."""
        return self.ids[self._owners[self._index(point)]]

    def walk(self, point: int) -> Iterator[str]:
        """Distinct nodes in ring order from the key's home (chash_bounded's walk)."""
        seen: set[str] = set()
        start, n = self._index(point), len(self._owners)
        for k in range(n):
            node = self.ids[self._owners[(start + k) % n]]
            if node not in seen:
                seen.add(node)
                yield node
                if len(seen) == len(self.ids):
                    return
