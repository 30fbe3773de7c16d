"""``kvgate sim``: run one engine simulator (see ``docs/simulator.md``).

Also runnable alone: ``python -m kvgate.sim.cli --port 8001``.
"""

from __future__ import annotations

import logging

import click

from ..policy.model import SimulatorConfig
from .server import DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_TOKENS, serve

_FIELDS = SimulatorConfig.model_fields


def _default(name: str):
    return _FIELDS[name].default


def _help(name: str) -> str:
    return _FIELDS[name].description or name


@click.command("sim")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535), help="TCP port.")
@click.option("--node-id", default="sim", show_default=True,
              help="Node id, sent in the X-Kvgate-Sim-Node header of every response.")
@click.option("--model", default=_default("model"), show_default=True, help=_help("model"))
@click.option("--time-scale", default=_default("time_scale"), show_default=True, type=float,
              help=_help("time_scale"))
@click.option("--prefill-s-per-token", default=_default("prefill_s_per_token"), show_default=True, type=float,
              help=_help("prefill_s_per_token"))
@click.option("--decode-s-per-token", default=_default("decode_s_per_token"), show_default=True, type=float,
              help=_help("decode_s_per_token"))
@click.option("--max-num-seqs", default=_default("max_num_seqs"), show_default=True, type=int,
              help=_help("max_num_seqs"))
@click.option("--block-size", default=_default("block_size"), show_default=True, type=int,
              help=_help("block_size"))
@click.option("--num-gpu-blocks", default=_default("num_gpu_blocks"), show_default=True, type=int,
              help=_help("num_gpu_blocks"))
@click.option("--stream-interval", default=_default("stream_interval"), show_default=True, type=int,
              help=_help("stream_interval"))
@click.option("--prefill-slots", default=1, show_default=True, type=click.IntRange(min=1),
              help="Prefills that run at once (1 = serialised, like one GPU's compute).")
@click.option("--max-model-len", default=DEFAULT_MAX_MODEL_LEN, show_default=True, type=click.IntRange(min=1),
              help="Longest prompt + completion (tokens); longer requests get a 400.")
@click.option("--default-max-tokens", default=DEFAULT_MAX_TOKENS, show_default=True, type=click.IntRange(min=1),
              help="Completion length when a request sets no max_tokens / max_completion_tokens.")
@click.option("--access-log/--no-access-log", default=False, show_default=True,
              help="Log every request (off: the demo sends thousands).")
def sim_command(host: str, port: int, node_id: str, model: str, time_scale: float, prefill_s_per_token: float,
                decode_s_per_token: float, max_num_seqs: int, block_size: int, num_gpu_blocks: int,
                stream_interval: int, prefill_slots: int, max_model_len: int, default_max_tokens: int,
                access_log: bool) -> None:
    """Serve an OpenAI-compatible engine simulator that behaves like one vLLM replica."""
    try:
        config = SimulatorConfig(
            model=model, time_scale=time_scale, prefill_s_per_token=prefill_s_per_token,
            decode_s_per_token=decode_s_per_token, max_num_seqs=max_num_seqs, block_size=block_size,
            num_gpu_blocks=num_gpu_blocks, stream_interval=stream_interval,
        )
    except ValueError as e:  # pydantic.ValidationError is a ValueError
        raise click.BadParameter(str(e)) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if access_log:
        logging.getLogger("aiohttp.access").setLevel(logging.INFO)
    serve(host, port, config, node_id, prefill_slots=prefill_slots, max_model_len=max_model_len,
          default_max_tokens=default_max_tokens, access_log=access_log)


if __name__ == "__main__":
    sim_command()
