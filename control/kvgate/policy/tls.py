"""The TLS files a policy names (``gateway.tls``, ``control.tls``): checked, digested and stamped.

A certificate and its key are checked the way the servers will load them: Python's ``ssl``
module (the OpenSSL nginx links too) loads the pair into a server context, so a file that is
not PEM, an encrypted key or a key of another certificate is refused here, at the field's path,
before nginx or the control plane's server sees it. The content digest goes into the rendered
``nginx.conf`` (:func:`nginx_tls`), so a certificate renewed in place changes the static config
and goes through the confirmed reload (:mod:`kvgate.control.tlswatch` notices the change).
"""

from __future__ import annotations

import hashlib
import os
import ssl
from pathlib import Path
from typing import Any

from .model import Policy, TlsConfig

SESSION_CACHE = "shared:kvgate_tls:10m"
"""nginx ``ssl_session_cache``: about 40,000 sessions (nginx: 1 MB holds about 4,000), one cache
for every worker, so a client resuming on another worker skips the full handshake."""
SESSION_TIMEOUT = "1h"


def tls_fields(policy: Policy) -> list[tuple[str, TlsConfig]]:
    """``[("gateway.tls", cfg), ("control.tls", cfg)]`` for the sections that set one."""
    out = []
    if policy.gateway.tls is not None:
        out.append(("gateway.tls", policy.gateway.tls))
    if policy.control.tls is not None:
        out.append(("control.tls", policy.control.tls))
    return out


def relative_tls(policy: Policy) -> bool:
    """Whether a TLS path of ``policy`` is relative (it then names a file of the policy's folder)."""
    return any(not os.path.isabs(f) for _, tls in tls_fields(policy) for f in (tls.certificate, tls.key))


def resolve_tls(policy: Policy, files_base: str | Path | None) -> Policy:
    """``policy`` with its relative ``gateway.tls`` / ``control.tls`` paths made absolute against
    ``files_base`` (the policy file's folder, as for ``static_answers``); ``policy`` itself when
    none is relative or no folder is known (:func:`pair_problems` then names the relative path)."""
    if files_base is None or not relative_tls(policy):
        return policy
    base = Path(files_base)

    def fixed(tls: TlsConfig | None) -> TlsConfig | None:
        if tls is None:
            return None
        return tls.model_copy(update={f: str(base / getattr(tls, f)) for f in ("certificate", "key")
                                      if not os.path.isabs(getattr(tls, f))})

    return policy.model_copy(update={"gateway": policy.gateway.model_copy(update={"tls": fixed(policy.gateway.tls)}),
                                     "control": policy.control.model_copy(update={"tls": fixed(policy.control.tls)})})


def _no_password() -> bytes:
    # without a callback OpenSSL would prompt on the terminal for an encrypted key
    raise ValueError("the key is encrypted")


def pair_problems(path: str, tls: TlsConfig) -> list[tuple[str, str]]:
    """What keeps ``tls`` from serving: unreadable files, no PEM certificate or key, an encrypted
    key, a key that is not the certificate's, as ``(field path, reason)`` (the loader makes
    them :class:`~kvgate.policy.loader.PolicyIssue`). ``path``: the section's path
    (``gateway.tls``); a problem names ``<path>.certificate`` or ``<path>.key``. Empty: the pair
    loads."""
    issues: list[tuple[str, str]] = []
    texts: dict[str, str] = {}
    for name, file in (("certificate", tls.certificate), ("key", tls.key)):
        if not os.path.isabs(file):
            issues.append((f"{path}.{name}", f"{file}: a relative path, but no folder is known to read it from: "
                           "apply the policy file (`kvgate apply FILE`: relative to FILE's folder) or name the "
                           "file by an absolute path"))
            continue
        try:
            with open(file, "rb") as fh:
                texts[name] = fh.read(1 << 20).decode("ascii", errors="replace")
        except OSError as exc:
            issues.append((f"{path}.{name}", f"cannot read {file}: {exc.strerror or exc}"))
    if issues:
        return issues
    if "-----BEGIN CERTIFICATE-----" not in texts["certificate"]:
        issues.append((f"{path}.certificate", f"{tls.certificate} holds no PEM certificate "
                                  "(-----BEGIN CERTIFICATE-----)"))
    if "PRIVATE KEY-----" not in texts["key"]:
        issues.append((f"{path}.key", f"{tls.key} holds no PEM private key"))
    elif "ENCRYPTED" in texts["key"]:
        issues.append((f"{path}.key", f"{tls.key} is an encrypted key: nginx would wait for a pass "
                                  "phrase; store it unencrypted (mode 0600)"))
    if issues:
        return issues
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(tls.certificate, tls.key, password=_no_password)
    except ssl.SSLError as exc:
        reason = str(exc.reason or exc)
        if "MISMATCH" in reason.upper():
            issues.append((f"{path}.key", f"{tls.key} is not the key of {tls.certificate} (key values "
                                      "mismatch): renew both, the certificate and its key"))
        else:
            issues.append((path, f"OpenSSL cannot load {tls.certificate} with {tls.key}: {reason}"))
    except (ValueError, OSError) as exc:
        issues.append((f"{path}.key", f"cannot load {tls.key}: {exc}"))
    return issues


def tls_problems(policy: Policy) -> list[tuple[str, str]]:
    """:func:`pair_problems` of every TLS section of ``policy``."""
    return [problem for path, tls in tls_fields(policy) for problem in pair_problems(path, tls)]


def files_digest(tls: TlsConfig) -> str:
    """sha256 (16 hex digits) over the certificate's and the key's contents. Raises ValueError
    naming the file that cannot be read (the apply is then refused, the running config serves)."""
    h = hashlib.sha256()
    for file in (tls.certificate, tls.key):
        try:
            with open(file, "rb") as fh:
                h.update(fh.read() + b"\0")
        except OSError as exc:
            raise ValueError(f"TLS file {file}: {exc.strerror or exc}") from None
    return h.hexdigest()[:16]


def files_stamp(tls: TlsConfig) -> tuple[Any, ...]:
    """A cheap change mark of the pair: ``(inode, size, mtime_ns)`` of each file (None for a file
    that cannot be stat'ed). A renewal by rename (certbot, cert-manager) changes the inode, one
    in place the mtime."""
    out: list[Any] = []
    for file in (tls.certificate, tls.key):
        try:
            st = os.stat(file)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


def nginx_tls(tls: TlsConfig | None) -> dict[str, Any] | None:
    """What ``nginx.conf.j2`` renders for the client listener's TLS (None: plain HTTP):
    the paths, ``ssl_protocols``, the session cache and the files' :func:`files_digest` (a comment
    in the config: a renewed pair is a changed config, hence a reload). Raises ValueError."""
    if tls is None:
        return None
    if not (os.path.isabs(tls.certificate) and os.path.isabs(tls.key)):
        raise ValueError(f"gateway.tls: {tls.certificate}, {tls.key}: relative paths, but no folder is known to "
                         "read them from (apply the policy file, or name the files by absolute paths)")
    return {"certificate": tls.certificate, "key": tls.key, "protocols": " ".join(tls.protocols),
            "session_cache": SESSION_CACHE, "session_timeout": SESSION_TIMEOUT, "digest": files_digest(tls)}
