"""Where a policy field is in its YAML text: the line an issue's path points at.

The admin page's policy editor shows each validation issue next to the line of the bad
field (``pools[0].nodes[1].url`` → the line of that ``url:`` key). Paths use the shape
of :class:`kvgate.policy.loader.PolicyIssue` (dotted keys, ``[i]`` for list items); a
YAML syntax error's path is ``line L, column C``.
"""

from __future__ import annotations

import re

import yaml

_TOKEN = re.compile(r"([^.\[\]]+)|\[(\d+)\]")
_SYNTAX = re.compile(r"^line (\d+)(?:, column \d+)?$")


def path_tokens(path: str) -> list[str | int]:
    """``"pools[0].nodes[1].url"`` → ``["pools", 0, "nodes", 1, "url"]``."""
    return [int(idx) if idx is not None and idx != "" else key for key, idx in _TOKEN.findall(path)]


def lines_of(text: str, paths: list[str]) -> list[int | None]:
    """:func:`line_of` for many paths, composing the YAML once."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        root = None
    return [_line_in(root, p) for p in paths]


def line_of(text: str, path: str) -> int | None:
    """The 1-based line of the field at ``path`` in ``text``, or None when it cannot be told.

    The line of the deepest part of the path that exists: a missing field points at the
    mapping that should hold it, an unknown field at its own key. ``"line 7, column 3"``
    (a syntax error) gives 7. The empty path (the whole document) gives None.
    """
    m = _SYNTAX.match(path.strip())
    if m:
        return int(m.group(1))
    if not path:
        return None
    return lines_of(text, [path])[0]


def _line_in(node, path: str) -> int | None:
    m = _SYNTAX.match(path.strip())
    if m:
        return int(m.group(1))
    if not path or node is None:
        return None
    line = None
    for token in path_tokens(path):
        if isinstance(node, yaml.MappingNode) and isinstance(token, str):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value == token:
                    line, node = key.start_mark.line + 1, value
                    break
            else:
                return line if line is not None else node.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(token, int):
            if token >= len(node.value):
                return line if line is not None else node.start_mark.line + 1
            node = node.value[token]
            line = node.start_mark.line + 1
        else:
            return line if line is not None else node.start_mark.line + 1
    return line
