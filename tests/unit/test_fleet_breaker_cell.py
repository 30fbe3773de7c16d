"""The Fleet page's breaker column (kvgate.web.admin.fleet) from the plane's gateway scrape."""

from kvgate.web.admin.fleet import _breaker_cell


def test_breaker_cell_states_and_unknowns() -> None:
    gw = {"ok": True, "breaker": {"n1": 0.0, "n2": 1.0, "n3": 2.0}}
    assert _breaker_cell(gw, "n1")[:2] == ("closed", "")
    assert _breaker_cell(gw, "n2")[:2] == ("open", "bad")
    assert _breaker_cell(gw, "n3")[:2] == ("half-open", "warn")
    # unknown: never shown as closed
    assert _breaker_cell(gw, "n4")[0] == "—"
    assert _breaker_cell({"ok": False, "breaker": {"n1": 1}}, "n1")[0] == "—"
    assert _breaker_cell({"ok": True}, "n1")[0] == "—"
    assert _breaker_cell(None, "n1")[0] == "—"
