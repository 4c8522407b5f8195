"""The layout of a round's relays (p2p_diloco.sync.relay): whom each member dials, and who forwards what."""

import math

import pytest
from hivemind.p2p import PeerID

from p2p_diloco.sync.relay import RelayLayout, relay_group_size


def members(n: int) -> tuple[PeerID, ...]:
    return tuple(PeerID(bytes([0x12, 0x20]) + bytes([i % 256, i // 256]) * 16) for i in range(n))


def test_the_group_size_is_the_smallest_any_member_asked_for_and_any_flat_request_wins():
    assert relay_group_size([32, 8, 16]) == 8
    assert relay_group_size([32, 0, 16]) == 0
    assert relay_group_size([]) == 0


@pytest.mark.parametrize("n, g", [(1000, 32), (64, 8), (24, 5), (17, 4), (5, 2)])
def test_each_member_dials_its_group_and_its_column_and_every_pair_is_connected(n, g):
    peers = members(n)
    layout = RelayLayout(peers, (True,) * n, g)
    k = math.ceil(n / g)
    assert layout.groups == k and not layout.flat
    sample = peers[:: max(1, n // 8)]
    for sender in sample:
        dialled = layout.dialled_by(sender, peers)
        assert len(dialled) <= (g - 1) + (k - 1) + 2, (n, g, len(dialled))  # + fallbacks where a column is short
        for reducer in peers:
            if reducer == sender:
                continue
            relay = layout.relay(sender, reducer)
            hops = [sender, reducer] if relay is None else [sender, relay, reducer]
            for a, b in zip(hops, hops[1:]):  # every hop stays in one group or one column
                (ga, ca), (gb, cb) = layout.cell(a), layout.cell(b)
                assert ga == gb or ca == cb, (a, b)
            assert relay not in (sender, reducer)
    if n >= 64:  # far fewer dials than a butterfly's n − 1
        assert max(len(layout.dialled_by(s, peers)) for s in sample) < (n - 1) / 4


def test_a_member_nobody_can_dial_relays_for_nobody():
    peers = members(9)
    reachable = tuple(i % 3 != 1 for i in range(9))  # every member of group 1 is a client
    layout = RelayLayout(peers, reachable, 3)
    for sender in peers:
        for reducer in peers:
            relay = layout.relay(sender, reducer)
            assert relay is None or reachable[peers.index(relay)]


def test_a_group_size_of_zero_or_at_least_the_group_is_a_flat_round():
    peers = members(6)
    for g in (0, 6, 10):
        layout = RelayLayout(peers, (True,) * 6, g)
        assert layout.flat
        assert all(layout.relay(s, r) is None for s in peers for r in peers)
        assert layout.dialled_by(peers[0], peers) == set(peers[1:])
