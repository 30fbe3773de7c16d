"""The ``kvgate`` command line: the click group, its lazy subcommands and the commands of
:mod:`kvgate.cli.stack` (up, down, status, validate) and :mod:`kvgate.cli.ops` (nodes, drain,
undrain, warm, apply, events, token).

Every command turns the errors a user can cause (a bad policy, a busy port, a
missing package) into one clear message and a non-zero exit code, never a
traceback: 2 for bad input (policy, arguments), 1 for a runtime failure.
"""

from __future__ import annotations

from pathlib import Path

import click


class _LazyGroup(click.Group):
    """Imports heavy subcommands (simulator, replay) only when they are invoked."""

    LAZY = {
        "sim": ("kvgate.sim.cli", "sim_command"),
        "replay": ("kvgate.bench.cli", "replay_command"),
        "bench": ("kvgate.bench.gateway", "bench_command"),
        "agent": ("kvgate.agent.cli", "agent_command"),
        "gateway": ("kvgate.gateway.supervisor", "gateway_command"),
        "control": ("kvgate.control.cli", "control_command"),
        "keys": ("kvgate.cli.keys", "keys_command"),
        "batches": ("kvgate.cli.batches", "batches_command"),
        "analyze": ("kvgate.analyze.cli", "analyze_command"),
        "costs": ("kvgate.cli.costs", "costs_command"),
        "log": ("kvgate.analyze.logexport", "log_group"),
        "batch-worker": ("kvgate.cli.batch", "batch_worker_command"),
        "semantic": ("kvgate.semantic.cli", "semantic_command"),
        "cache": ("kvgate.cli.cache", "cache_group"),
    }

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self.LAZY))

    def get_command(self, ctx, name):
        if name in self.LAZY:
            import importlib

            module, attr = self.LAZY[name]
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), envvar="KVGATE_RUN_DIR",
              default=None, help="Where pid files, logs and the nginx prefix live [default: ./.kvgate/run].")
@click.version_option(package_name="kvgate")
@click.pass_context
def main(ctx: click.Context, run_dir: Path | None) -> None:
    """kvgate: a cache-affinity gateway for fleets of LLM inference servers."""
    ctx.obj = {"run_dir": run_dir}


def _register() -> None:
    from .ops import COMMANDS as OPS
    from .stack import COMMANDS as STACK

    for cmd in STACK + OPS:
        main.add_command(cmd)


_register()
