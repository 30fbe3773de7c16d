"""The admin token: one random secret per run directory, in ``<run_dir>/admin.token`` (mode 0600)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

TOKEN_FILE = "admin.token"


def read_token(path: Path) -> str:
    """The token in ``path`` (first line, stripped). Raises OSError / ValueError (empty file)."""
    token = Path(path).read_text(encoding="utf-8").strip().splitlines()
    if not token or not token[0].strip():
        raise ValueError(f"{path} is empty")
    return token[0].strip()


def ensure_token(path: Path) -> tuple[str, bool]:
    """Read the token at ``path``, creating it (``secrets.token_urlsafe(32)``, mode 0600) if missing.

    Returns ``(token, created)``. Creation is atomic (``O_EXCL``), so two starting
    processes agree on one token."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_token(path), False
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(token + "\n")
    return token, True
