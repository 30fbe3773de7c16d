"""Edits to a policy's YAML text that keep what the operator wrote around them.

The policy file is the operator's: its comments, key order, quoting and flow mappings
(``{id: n1, url: ...}``) must survive an edit made from the admin page. The text is
loaded with ruamel.yaml's round-trip loader, changed in place and dumped back with the
indentation the file already uses (the candidate styles are tried on the unchanged
document and the one that reproduces the file, or comes closest, is kept).

The result is YAML text only: the caller validates it as a policy
(:func:`kvgate.policy.parse_policy_text`) before applying it.
"""

from __future__ import annotations

import difflib
import io
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap
from ruamel.yaml.error import CommentMark, YAMLError
from ruamel.yaml.tokens import CommentToken

# (mapping indent, sequence indent, sequence dash offset): "key:\n  - item" is (2, 4, 2),
# "key:\n- item" is (2, 2, 0)
_INDENTS = ((2, 4, 2), (2, 2, 0), (4, 4, 2), (4, 6, 4), (4, 4, 0), (4, 2, 0), (3, 3, 0), (3, 5, 2))


def _yaml(indent: tuple[int, int, int]) -> YAML:
    y = YAML(typ="rt")
    y.preserve_quotes = True
    y.width = 4096  # never re-wrap a long line
    y.indent(mapping=indent[0], sequence=indent[1], offset=indent[2])
    return y


def _dump(y: YAML, data: Any) -> str:
    buf = io.StringIO()
    y.dump(data, buf)
    return buf.getvalue()


def _load(text: str) -> tuple[CommentedMap, tuple[int, int, int]]:
    """The round-trip document and the indentation style that best reproduces ``text``."""
    try:
        data = _yaml(_INDENTS[0]).load(text)
    except YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"the policy is not valid YAML{where}: {problem}") from None
    if not isinstance(data, CommentedMap):
        kind = "empty" if data is None else f"a YAML {type(data).__name__}"
        raise ValueError(f"the policy must be a YAML mapping (version:, gateway:, pools: ...), not {kind}")
    best, best_score = _INDENTS[0], -1.0
    lines = text.splitlines()
    for indent in _INDENTS:
        out = _dump(_yaml(indent), data)
        if out == text:
            return data, indent
        score = difflib.SequenceMatcher(None, lines, out.splitlines(), autojunk=False).ratio()
        if score > best_score:
            best, best_score = indent, score
    return data, best


def _append(m: CommentedMap, key: str, value: Any) -> None:
    """``m[key] = value`` as a new last key, placed before what the file has after the old
    last key's line (blank lines, comments about the next section), not after it: ruamel
    keeps those with the old last key."""
    last = next(reversed(m)) if m else None
    m[key] = value
    item = m.ca.items.get(last) if last is not None else None
    if not item or len(item) < 3 or item[2] is None:
        return
    tok = item[2]
    head, _, rest = tok.value.partition("\n")
    if not rest:
        return  # only the old key's own end-of-line comment
    if head.strip():
        tok.value = head + "\n"  # its end-of-line comment stays
    else:
        item[2] = None
    m.ca.items.setdefault(key, [None, None, None, None])[2] = CommentToken("\n" + rest, CommentMark(0), None)


def bump_namespace_version(text: str, at_least: int = 0) -> tuple[str, int]:
    """Raise ``cache.namespace_version`` by one in the policy text (which invalidates the
    whole response cache: every cache key carries the version), keeping comments, key
    order and formatting. With ``at_least``, the new version is at least that (the control
    plane passes one more than the highest version ever in force, so a number is never reused).

    An absent ``namespace_version`` counts as 1 (the model's default), so the result has 2;
    an absent (or empty) ``cache`` section is created, before ``pools`` when there is one.

    Returns:
        ``(new text, new version)``.

    Raises:
        ValueError: the text is not YAML, not a mapping, ``cache`` is not a mapping, or
            ``namespace_version`` is not an integer.
    """
    data, indent = _load(text)
    cache = data.get("cache")
    if cache is None:
        cache = CommentedMap()
        if "cache" in data:
            data["cache"] = cache  # "cache:" with nothing under it
        elif "pools" in data:
            data.insert(list(data.keys()).index("pools"), "cache", cache)
            if "\n\n" in text:  # sections are separated by blank lines: this one too
                cache.ca.items["namespace_version"] = [None, None, CommentToken("\n\n", CommentMark(0), None), None]
        else:
            _append(data, "cache", cache)
    elif not isinstance(cache, dict):
        raise ValueError(f"cache must be a mapping, not {type(cache).__name__}")
    current = cache.get("namespace_version", 1)
    if isinstance(current, bool) or not isinstance(current, int):
        raise ValueError(f"cache.namespace_version must be an integer, not {current!r}")
    new = max(int(current) + 1, int(at_least))
    if "namespace_version" in cache or not isinstance(cache, CommentedMap):
        cache["namespace_version"] = new
    else:
        _append(cache, "namespace_version", new)
    return _dump(_yaml(indent), data), new
