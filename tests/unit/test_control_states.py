"""The node state machine: exactly the moves of the design diagram are allowed, every other
one is refused with a message that names the node, its state and the allowed sources."""

from __future__ import annotations

import itertools

import pytest

from kvgate.control import states as st

# The design (DESIGN.md, Operations), written out independently of states.TRANSITIONS:
# the happy path, drain from anywhere before drained, ejection of warming, ramping and active
# nodes (a joining node just waits for its first passing check), recovery from ejected, and
# undrain back through warming.
EXPECTED = {
    ("joining", "warming"), ("warming", "ramping"), ("ramping", "active"), ("active", "draining"),
    ("draining", "drained"),
    ("joining", "draining"), ("warming", "draining"), ("ramping", "draining"),
    ("warming", "ejected"), ("ramping", "ejected"), ("active", "ejected"),
    ("ejected", "warming"), ("ejected", "ramping"), ("ejected", "active"), ("ejected", "draining"),
    ("draining", "warming"), ("drained", "warming"),
}


def test_states_and_serving_set() -> None:
    assert st.STATES == ("joining", "warming", "ramping", "active", "draining", "drained", "ejected")
    assert st.SERVING == {"ramping", "active"}
    assert set(st.TRANSITIONS) == set(st.STATES)


def test_transition_table_is_the_design() -> None:
    table = {(a, b) for a, targets in st.TRANSITIONS.items() for b in targets}
    assert table == EXPECTED


@pytest.mark.parametrize(("current", "wanted"), sorted(EXPECTED))
def test_allowed_moves_pass(current: str, wanted: str) -> None:
    st.check("n1", current, wanted)  # does not raise


REFUSED = sorted(set(itertools.product(st.STATES, st.STATES)) - EXPECTED)


@pytest.mark.parametrize(("current", "wanted"), REFUSED)
def test_every_other_move_is_refused(current: str, wanted: str) -> None:
    with pytest.raises(st.InvalidTransition) as info:
        st.check("n1", current, wanted)
    exc = info.value
    assert (exc.node_id, exc.current, exc.wanted) == ("n1", current, wanted)
    assert isinstance(exc, ValueError)


@pytest.mark.parametrize("wanted", st.STATES)
def test_unknown_current_state_is_refused(wanted: str) -> None:
    with pytest.raises(st.InvalidTransition):
        st.check("n1", "lost", wanted)


def test_message_names_node_state_and_allowed_sources() -> None:
    with pytest.raises(st.InvalidTransition) as info:
        st.check("n7", st.DRAINED, st.DRAINING, action="drain")
    msg = str(info.value)
    assert msg.startswith("cannot drain node 'n7': it is drained")
    sources = sorted(a for a, b in EXPECTED if b == "draining")
    assert sources == ["active", "ejected", "joining", "ramping", "warming"]
    assert f"(draining is reachable only from {', '.join(sources)})" in msg


def test_message_for_undrain_of_an_active_node() -> None:
    with pytest.raises(st.InvalidTransition) as info:
        st.check("n2", st.ACTIVE, st.WARMING, action="undrain")
    msg = str(info.value)
    assert "cannot undrain node 'n2': it is active" in msg
    for source in ("draining", "drained", "ejected", "joining"):
        assert source in msg.split("reachable only from", 1)[1]
    assert "active" not in msg.split("reachable only from", 1)[1]


def test_message_without_action_says_move_to() -> None:
    with pytest.raises(st.InvalidTransition, match=r"cannot move to active node 'x': it is joining "
                                                   r"\(active is reachable only from ejected, ramping\)"):
        st.check("x", st.JOINING, st.ACTIVE)
