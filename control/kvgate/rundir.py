"""The run directory: where one local kvgate stack keeps its files.

Default ``./.kvgate/run`` (or ``$KVGATE_RUN_DIR``; ``kvgate --run-dir`` wins over both)::

    run/
      state.json          which policy file the stack runs (so `down`/`status` need no argument)
      policy.yaml         a copy of that policy, taken when `kvgate up` succeeded
      admin.token         the admin token (mode 0600; kvgate.control.token)
      lock                held by `kvgate up` / `down` (two at once would race)
      pids/<name>.pid     one per process the stack started (redis, sim-<node>, control, agent-<node>)
      logs/<name>.log     stdout/stderr of each process
      redis/              the private Redis's working directory (no persistence)
      nginx/              the gateway's nginx prefix: conf/, logs/, temp/ (written by the control plane)

Both the supervisor (:mod:`kvgate.stack`) and the control plane's client
(:mod:`kvgate.control.client`: which URL, which token) read it; this module imports neither.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .control.token import TOKEN_FILE
from .policy import Policy, load_policy

DEFAULT_RUN_DIR = Path(".kvgate") / "run"


def default_run_dir() -> Path:
    """``$KVGATE_RUN_DIR`` if set, else ``./.kvgate/run`` (absolute)."""
    return Path(os.environ.get("KVGATE_RUN_DIR", DEFAULT_RUN_DIR)).resolve()


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory (nothing is created until a caller writes).

    Args:
        root: the run directory; None = :func:`default_run_dir`. Made absolute.
    """

    root: Path

    def __init__(self, root: Path | str | None = None):
        object.__setattr__(self, "root", Path(root or default_run_dir()).resolve())

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def redis_dir(self) -> Path:
        return self.root / "redis"

    @property
    def nginx_prefix(self) -> Path:
        return self.root / "nginx"

    @property
    def lock_file(self) -> Path:
        return self.root / "lock"

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    @property
    def running_policy_file(self) -> Path:
        """A copy of the policy the stack runs, taken when ``up`` succeeded (the operator's
        file may have been edited since)."""
        return self.root / "policy.yaml"

    @property
    def token_file(self) -> Path:
        """The admin token of this run directory (mode 0600; created by the first ``up``)."""
        return self.root / TOKEN_FILE

    def pid_file(self, name: str) -> Path:
        return self.pids / f"{name}.pid"

    def log_file(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def policy_path(self) -> Path | None:
        """The operator's policy file the running stack was started from, if any."""
        try:
            return Path(json.loads(self.state_file.read_text())["policy"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def files_base(self) -> Path | None:
        """The folder the running policy's relative file names (``static_answers``) are read from:
        the one a ``kvgate apply FILE`` since ``up`` recorded (FILE's folder), else the folder of
        the file ``up`` started from."""
        try:
            base = json.loads(self.state_file.read_text()).get("files_base")
        except (OSError, ValueError, AttributeError):
            base = None
        if base:
            return Path(base)
        original = self.policy_path()
        return original.parent if original else None

    def record_files_base(self, base: str | Path | None) -> None:
        """Note the running policy's files folder in ``state.json`` (the control plane, after an
        apply through its API; nothing when no stack was recorded or ``base`` is None)."""
        try:
            state = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return
        if not isinstance(state, dict) or base is None or state.get("files_base") == str(base):
            return
        state["files_base"] = str(base)
        tmp = self.state_file.with_suffix(".json.new")
        tmp.write_text(json.dumps(state) + "\n")
        os.replace(tmp, self.state_file)

    def load_running_policy(self) -> Policy | None:
        """The policy the stack runs (its copy in the run directory), or None if none was started.

        Raises:
            PolicyError: the copy no longer validates (a newer kvgate with stricter rules).
        """
        if self.running_policy_file.exists():
            # relative file names (static_answers) are the operator's file's, not the copy's
            return load_policy(self.running_policy_file, files_base=self.files_base())
        return None

    def record_running(self, policy_path: Path) -> None:
        """Note ``policy_path`` as the running policy: its text copied to ``policy.yaml``
        (atomically) and its absolute path in ``state.json``."""
        tmp = self.running_policy_file.with_suffix(".yaml.new")
        tmp.write_text(Path(policy_path).read_text(encoding="utf-8"), encoding="utf-8")
        os.replace(tmp, self.running_policy_file)
        self.state_file.write_text(json.dumps({"policy": str(Path(policy_path).resolve()),
                                               "files_base": str(Path(policy_path).resolve().parent)}) + "\n")

    def clear_running(self) -> None:
        """Forget the running policy (``kvgate down``)."""
        self.running_policy_file.unlink(missing_ok=True)
        self.state_file.unlink(missing_ok=True)
