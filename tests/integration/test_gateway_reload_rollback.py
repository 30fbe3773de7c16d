"""A reload that fails is rolled back with its runtime (review of issue 10): the refused
config's conf/runtime.json must not stay behind, or the next start of nginx (a restarted
container, `kvgate up` after a crash) seeds its runtime from a document that names pools the
installed kvgate.json does not have, and init_by_lua refuses to start."""

from __future__ import annotations

import socket
from contextlib import closing

import pytest

from gwfixtures import free_port
from kvgate.nginxctl import NginxError
from kvgate.policy.loader import parse_policy


def test_a_failed_reload_without_a_previous_runtime_json_leaves_none(start_sims, start_gateway) -> None:
    sims = start_sims(2, prefix="rb")
    gw = start_gateway(sims[:1], None)
    runtime = gw.nginx.prefix / "conf/runtime.json"
    # a gateway installed before issue 10 has no runtime.json (init seeds from kvgate.json)
    runtime.unlink()
    data = gw.policy.model_dump(mode="json")
    pool2 = {**data["pools"][0], "name": "second", "models": ["other-model"],
             "nodes": [{"id": sims[1].node_id, "url": sims[1].url}]}
    data["pools"].append(pool2)
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        data["gateway"]["listen"] = "127.0.0.1:%d" % busy.getsockname()[1]
        with pytest.raises(NginxError):
            gw.nginx.apply(parse_policy(data))
    # rolled back: no runtime.json naming the refused pool
    assert not runtime.exists() or '"second"' not in runtime.read_text()
    # and nginx starts again on the installed (old) files
    gw.nginx.stop()
    gw.nginx.start()
    gw.nginx.wait_ready(gw.listen)
    assert gw.chat("after the rollback", max_tokens=1).status_code == 200
