"""Certificate renewal: the reconciler notices new TLS files and loads them (docs/tls.md).

Every tick (``control.tick_s``) the files of ``gateway.tls`` and ``control.tls`` are stat'ed
(:func:`kvgate.policy.tls.files_stamp`: inode, size, mtime; two ``stat`` calls, microseconds).
When a pair's stamp changes, the pair is checked as the policy's validation does
(:func:`kvgate.policy.tls.pair_problems`): a certificate that does not load or does not match its
key is refused with a ``reload_failed`` event naming the field, and the running one keeps
serving. A good ``gateway.tls`` pair goes through the plane's apply: the files' digest is in the
rendered ``nginx.conf`` (:func:`kvgate.policy.tls.nginx_tls`), so the config differs and the
confirmed reload runs (``nginx -t``, swap, reload, rollback; in-flight requests finish on the old
workers). A good ``control.tls`` pair is loaded into the control plane's HTTPS server for new
connections (:meth:`kvgate.control.https.TlsServer.reload`).

A renewal that writes the certificate and the key one after the other may be seen half done:
the mismatch is refused, and the second write changes the stamp again, which loads the pair.
A renewal between the start's apply and the first tick is not missed: at first sight the files'
content digest is compared with the one the running config was made from (the ``# files
digest`` line of the installed ``nginx.conf``; :attr:`kvgate.control.https.TlsServer.digest`).
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any, Protocol

from ..fleet.events import EventKind
from ..policy.model import TlsConfig
from ..policy.tls import files_digest, files_stamp, pair_problems
from .exceptions import ApplyError

if TYPE_CHECKING:
    from .plane import ControlPlane

log = logging.getLogger("kvgate.control")

_CONF_DIGEST = re.compile(r"^\s*# files digest: ([0-9a-f]+)$", re.MULTILINE)


class ReloadableServer(Protocol):
    """The control plane's HTTPS server as the watch sees it (:class:`kvgate.control.https.TlsServer`)."""

    digest: str | None

    def reload(self, tls: TlsConfig) -> None: ...


class TlsWatch:
    """The last seen stamp of each TLS pair of the plane's policy.

    Args:
        plane: the control plane (its policy, events and apply).
        control_server: the running HTTPS server of the control plane, whose pair a renewal
            reloads (``kvgate control`` sets it when it serves HTTPS; None: nothing to reload).
    """

    def __init__(self, plane: ControlPlane, control_server: ReloadableServer | None = None):
        self.plane = plane
        self.control_server = control_server
        self._seen: dict[str, Any] = {}

    def _running_digest(self, field: str) -> str | None:
        """The files digest the running listener was loaded with (None: unknown)."""
        if field == "control.tls":
            return self.control_server.digest if self.control_server is not None else None
        try:
            conf = (self.plane.nginx.prefix / "conf/nginx.conf").read_text()
        except OSError:
            return None
        m = _CONF_DIGEST.search(conf)
        return m.group(1) if m else None

    def _changed(self, field: str, tls: TlsConfig | None) -> bool:
        if tls is None:
            self._seen.pop(field, None)
            return False
        stamp = (tls.certificate, tls.key, files_stamp(tls))
        before = self._seen.get(field)
        self._seen[field] = stamp
        if before is None:
            # first sight: changed since the running listener read them?
            running = self._running_digest(field)
            try:
                return running is not None and running != files_digest(tls)
            except ValueError:
                return True  # unreadable now: the check says why
        return before != stamp

    def _refused(self, field: str, tls: TlsConfig) -> bool:
        issues = pair_problems(field, tls)
        if issues:
            self.plane.metrics.reloads.labels("failed").inc()  # kvgate_control_reloads_total{result="failed"}
            self.plane.event(EventKind.RELOAD_FAILED, f"renewed TLS files refused, the running certificate keeps "
                             f"serving: {'; '.join(f'{p}: {r}' for p, r in issues)}",
                             issues=[{"path": p, "reason": r} for p, r in issues])
        return bool(issues)

    def check(self) -> str | None:
        """One look at the files (the caller holds the plane's :meth:`changing`, as for its apply).
        Returns what was done to ``gateway.tls`` (``"reloaded"``, ``"refused"``, ``"failed"``…;
        None: unchanged)."""
        policy = self.plane.policy
        if policy is None:
            return None
        result = None
        gw = policy.gateway.tls
        if self._changed("gateway.tls", gw):
            assert gw is not None
            if self._refused("gateway.tls", gw):
                result = "refused"
            else:
                try:
                    # forced: the runtime is unchanged, but the rendered config is not
                    result = self.plane.apply_runtime(force=True)
                except ApplyError:
                    result = "failed"  # recorded (reload_failed); the running config keeps serving
                else:
                    log.info("gateway.tls: renewed files of %s loaded (nginx %s)", gw.certificate, result)
        ctl = policy.control.tls
        if self._changed("control.tls", ctl) and self.control_server is not None:
            assert ctl is not None
            if not self._refused("control.tls", ctl):
                try:
                    self.control_server.reload(ctl)
                    self.plane.event(EventKind.RELOAD, f"control.tls: renewed certificate {ctl.certificate} loaded "
                                     "for new connections")
                except (OSError, ValueError) as exc:
                    self.plane.event(EventKind.RELOAD_FAILED, f"control.tls: renewed files not loaded, the running "
                                     f"certificate keeps serving: {exc}")
        return result
