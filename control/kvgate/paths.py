"""Where kvgate's files that are not Python live: the nginx templates and the Lua modules.

One setting decides: ``$KVGATE_HOME``, a folder holding ``nginx/*.j2`` and ``lua/kvgate/*.lua``
(a checkout of the repository, or a copy an operator edits). Without it, the package's own
data folder ``kvgate/share/`` is used: in a checkout (and an editable install) its ``nginx``
and ``lua`` entries are symlinks to the repository's ``nginx/`` and ``lua/``; a wheel carries
copies of them as package data (pyproject.toml ``[tool.setuptools.package-data]``). The admin
page's templates and static files are package data of :mod:`kvgate.web.admin` (Flask finds
them next to its blueprint).
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

ENV = "KVGATE_HOME"


def home() -> Path:
    """The folder with ``nginx/`` and ``lua/``: ``$KVGATE_HOME``, else ``kvgate/share``.

    Raises:
        FileNotFoundError: ``$KVGATE_HOME`` is set to a folder without ``nginx/nginx.conf.j2``
            (a typo must not fall back silently to other templates).
    """
    env = os.environ.get(ENV)
    if env:
        root = Path(env).expanduser().resolve()
        if not (root / "nginx" / "nginx.conf.j2").is_file():
            raise FileNotFoundError(f"${ENV}={env}: no nginx/nginx.conf.j2 there (it must hold kvgate's "
                                    "nginx/ and lua/ folders)")
        return root
    return Path(str(files("kvgate"))) / "share"


def template_dir() -> Path:
    """The nginx templates (``nginx.conf.j2``, ``upstreams.conf.j2``)."""
    return (home() / "nginx").resolve()


def lua_dir() -> Path:
    """The folder with ``kvgate/*.lua`` (nginx's ``lua_package_path`` root)."""
    return (home() / "lua").resolve()
