"""The descriptor hand-out's waiting room (daemon/access/fdserver.py): connections that have not sent
their request yet, per uid. One uid's flood displaces only its own connections; when all places
are taken, the uid holding the most gives one up; silent connections are due after the timeout."""

from __future__ import annotations

import random

import pytest

from h5serve.daemon.access.fdserver import MAX_CONNECTIONS, MAX_CONNECTIONS_PER_UID, REQUEST_TIMEOUT_S, WaitingRoom

pytestmark = pytest.mark.timeout(60)

ATTACKER, VICTIM, OTHER = 1001, 1002, 1003


def _enter(room: WaitingRoom[str], conn: str, uid: int, now: float = 0.0) -> str | None:
    """What the hand-out does for a silent newcomer: close what crowds it, let it wait."""
    crowded = room.crowding(uid)
    if crowded is not None:
        room.remove(crowded)
    room.admit(conn, uid, now)
    return crowded


def test_a_uid_at_its_share_displaces_only_its_own_oldest() -> None:
    room: WaitingRoom[str] = WaitingRoom(per_uid=3, total=10, timeout=1.0)
    _enter(room, "victim", VICTIM)
    for i in range(3):
        assert _enter(room, f"a{i}", ATTACKER) is None
    assert [_enter(room, f"a{i}", ATTACKER) for i in range(3, 6)] == ["a0", "a1", "a2"]
    assert room.held_by(ATTACKER) == 3 and "victim" in room and len(room) == 4


def test_a_flood_of_one_uid_never_displaces_another() -> None:
    room: WaitingRoom[str] = WaitingRoom(MAX_CONNECTIONS_PER_UID, MAX_CONNECTIONS, REQUEST_TIMEOUT_S)
    _enter(room, "victim", VICTIM)
    displaced = [_enter(room, f"a{i}", ATTACKER, now=i * 1e-4) for i in range(5000)]
    assert "victim" in room and "victim" not in displaced
    assert room.held_by(ATTACKER) == MAX_CONNECTIONS_PER_UID
    assert _enter(room, "victim-2", VICTIM) is None  # the victim still has its own share


def test_when_full_the_uid_holding_the_most_gives_one_up() -> None:
    room: WaitingRoom[str] = WaitingRoom(per_uid=4, total=6, timeout=1.0)
    for i in range(4):
        _enter(room, f"a{i}", ATTACKER)
    for i in range(2):
        _enter(room, f"v{i}", VICTIM)
    assert _enter(room, "o0", OTHER) == "a0"  # the attacker holds the most
    assert _enter(room, "o1", OTHER) == "a1"
    assert _enter(room, "o2", OTHER) == "o0"  # all at two: the newcomer's own uid gives one up
    assert sorted(room.held_by(uid) for uid in (ATTACKER, VICTIM, OTHER)) == [2, 2, 2]


def test_every_uid_keeps_its_fair_share_whatever_the_others_do() -> None:
    """Random arrivals of five uids (one of them ten times as often): a uid holding fewer than
    min(per_uid, total // uids) places never loses one to another uid's arrival."""
    per_uid, total, uids = 5, 12, [1, 2, 3, 4, 5]
    fair = min(per_uid, total // len(uids))
    room: WaitingRoom[int] = WaitingRoom(per_uid, total, timeout=1.0)
    rng = random.Random(4)
    owner: dict[int, int] = {}
    for conn in range(20_000):
        uid = 1 if rng.random() < 0.7 else rng.choice(uids)
        crowded = room.crowding(uid)
        if crowded is not None:
            assert owner[crowded] == uid or room.held_by(owner[crowded]) > fair, (uid, owner[crowded])
            room.remove(crowded)
        room.admit(conn, uid, 0.0)
        owner[conn] = uid
        if rng.random() < 0.3:  # some connections ask (and leave) before they are displaced
            room.remove(rng.choice(room.connections()))
        assert len(room) <= total and all(room.held_by(u) <= per_uid for u in uids)


def test_silent_connections_are_due_after_the_timeout() -> None:
    room: WaitingRoom[str] = WaitingRoom(per_uid=4, total=8, timeout=0.5)
    assert room.next_deadline() is None and room.expired(100.0) == []
    room.admit("a", ATTACKER, now=10.0)
    room.admit("v", VICTIM, now=10.2)
    room.admit("b", ATTACKER, now=10.3)
    assert room.next_deadline() == pytest.approx(10.5)
    assert room.expired(10.49) == []
    assert room.expired(10.5) == ["a"]
    assert sorted(room.expired(10.8)) == ["a", "b", "v"]
    assert room.remove("a") == ATTACKER and room.remove("a") is None
    assert room.next_deadline() == pytest.approx(10.7)


def test_admitting_without_room_or_twice_is_refused() -> None:
    room: WaitingRoom[str] = WaitingRoom(per_uid=1, total=2, timeout=1.0)
    room.admit("a", ATTACKER, 0.0)
    with pytest.raises(ValueError):
        room.admit("a2", ATTACKER, 0.0)
    with pytest.raises(ValueError):
        room.admit("a", VICTIM, 0.0)
    for per_uid, total, timeout in ((0, 4, 1.0), (5, 4, 1.0), (1, 4, 0.0)):
        with pytest.raises(ValueError):
            WaitingRoom(per_uid, total, timeout)
