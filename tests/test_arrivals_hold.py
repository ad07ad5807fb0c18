"""Free slots kept for the top level's expected arrivals (core.arrivals_hold)."""

from __future__ import annotations

import math

import pytest

from qosgate.core.arrivals_hold import (
    ArrivalsHold,
    arrivals_hold,
    expected_arrivals,
    shortfall,
)

NOW = 100.0
BUDGET = 0.3


def test_completions_that_come_evenly_keep_nothing():
    # 256 running, one ending every 25 ms (hold 6.4 s): 12 end within the
    # budget, more than the top level's 5 a second bring in any interval.
    starts = [NOW - 6.4 + 0.025 * i for i in range(256)]
    assert arrivals_hold(starts, NOW, 6.4, 5.0, BUDGET) == 0.0


def test_a_gap_ahead_keeps_what_its_arrivals_need():
    # 100 running end within the next second, then none for 2 s: an arrival
    # just before the gap's end waits for the next completion unless a slot
    # was kept, and the gap's arrivals are 5/s over the 2 s less the budget.
    hold_s = 6.0
    starts = [NOW - hold_s + 0.01 * i for i in range(100)]
    starts += [NOW - hold_s + 3.0 + 0.01 * i for i in range(100)]
    # Now the 100 ending ahead of the gap cover its arrivals: nothing kept.
    assert arrivals_hold(starts, NOW, hold_s, 5.0, BUDGET) == 0.0
    # Once those have ended (and been refilled below the top level), the gap
    # needs slots kept: its arrivals until the first end after it, less the
    # budget an arrival may wait for that end.
    later = NOW + 1.0
    after = [s for s in starts if s + hold_s > later]
    kept = arrivals_hold(after, later, hold_s, 5.0, BUDGET)
    # The first ends after the gap are random counts too: an arrival just
    # before the second may still find none of them done.
    worst = max(shortfall(5.0, 2.0 - BUDGET + 0.01 * k, k) for k in range(100))
    assert kept == pytest.approx(worst)
    assert expected_arrivals(5.0, 2.0 - BUDGET) < kept < expected_arrivals(5.0, 2.0 - BUDGET) + 1


def test_runs_the_backend_already_freed_do_not_count_as_ahead():
    hold_s = 6.0
    starts = [NOW - hold_s + 0.05 + 0.001 * i for i in range(30)]  # end within the budget
    starts += [NOW - hold_s + 2.0]
    assert arrivals_hold(starts, NOW, hold_s, 5.0, BUDGET) == 0.0
    # The backend reports those 30 slots free already: they were refilled or
    # are free now, and none of them ends again.
    kept = arrivals_hold(starts, NOW, hold_s, 5.0, BUDGET, ended=30)
    assert kept == pytest.approx(expected_arrivals(5.0, 2.0 - BUDGET))


def test_few_completions_within_the_budget_keep_a_slot():
    # 256 running, one ending every 100 ms: one or two end within a 150 ms
    # budget on average, and as a random count often none, so a slot is kept
    # for the top level's next arrival.
    budget = 0.15
    starts = [NOW - 25.6 + 0.1 * i for i in range(256)]
    assert arrivals_hold(starts, NOW, 25.6, 2.0, budget) >= 1.0
    # Six or more ends within the budget are enough to count on.
    starts = [NOW - 6.4 + 0.025 * i for i in range(256)]
    assert arrivals_hold(starts, NOW, 6.4, 2.0, budget) == 0.0
    assert shortfall(2.0, 0.0, 6) < 0.0 < shortfall(2.0, 0.0, 5)
    assert shortfall(2.0, 0.0, 0) == expected_arrivals(2.0, 0.0)


def test_runs_past_their_expected_end_are_not_counted_as_about_to_end():
    # Lengths vary: 100 of the running are past the time runs lately held a
    # slot (long ones), while the backend completes 5 a second. Those are not
    # 100 ends within the budget; what it completes in as long is.
    hold_s = 6.0
    starts = [NOW - hold_s - 10.0 + 0.1 * i for i in range(100)]
    starts += [NOW - hold_s + 1.0 + 0.05 * i for i in range(100)]
    assert arrivals_hold(starts, NOW, hold_s, 5.0, BUDGET) == 0.0  # no bound: 100 ahead
    kept = arrivals_hold(starts, NOW, hold_s, 5.0, BUDGET, end_rate=5.0)
    assert kept >= expected_arrivals(5.0, 0.0)
    # A backend that completes 100 a second does bring those ends in time.
    assert arrivals_hold(starts, NOW, hold_s, 5.0, BUDGET, end_rate=100.0) == 0.0


def test_the_reserve_counts_toward_the_slots_kept():
    def measured(reserve: int) -> ArrivalsHold:
        hold = ArrivalsHold(max_share=0.5, reserve=reserve)
        for i in range(50):
            hold.arrived(NOW - 10.0 + 0.2 * i)  # 5 a second
            hold.ended(NOW - 10.0 + 0.2 * i, NOW - 16.0 + 0.2 * i)  # each held 6 s
        return hold

    # The 8 running end in 0.5 s: an arrival in the next 0.2 s finds none.
    starts = [NOW - 5.5] * 8
    room = {"free_slots": 8, "backend_slots": 16}
    wanted = math.ceil(expected_arrivals(5.0, 0.5 - BUDGET) - 1e-9)
    assert wanted == 4
    assert measured(0).slots(NOW, starts, BUDGET, **room) == wanted
    # Three of them are the reserve's, free for the top level already.
    assert measured(3).slots(NOW, starts, BUDGET, **room) == wanted - 3
    assert measured(6).slots(NOW, starts, BUDGET, **room) == 0


def test_no_top_level_arrivals_or_no_estimate_keep_nothing():
    starts = [NOW - 1.0]
    assert arrivals_hold(starts, NOW, 6.0, 0.0, BUDGET) == 0.0
    assert arrivals_hold(starts, NOW, 0.0, 5.0, BUDGET) == 0.0


def test_the_estimates_and_the_cap():
    hold = ArrivalsHold(max_share=0.25)
    starts = [NOW - 2.0] * 8
    room = {"free_slots": 8, "backend_slots": 16}
    assert hold.slots(NOW, starts, BUDGET, **room) == 0  # nothing measured yet
    for i in range(50):
        hold.arrived(NOW - 10.0 + 0.2 * i)  # 5 a second
        hold.ended(NOW - 10.0 + 0.2 * i, NOW - 16.0 + 0.2 * i)  # each held 6 s
    # The 8 running end in 4 s: the arrivals until then would want more than
    # a quarter of 16 slots.
    assert expected_arrivals(5.0, 4.0 - BUDGET) > 4
    assert hold.slots(NOW, starts, BUDGET, **room) == 4
    # The backend does not say its slots: free and running make them.
    assert hold.slots(NOW, starts, BUDGET, free_slots=8, backend_slots=None) == 4
    assert hold.slots(NOW, starts, BUDGET, free_slots=4, backend_slots=None) == 3
    # It reports 8 free of 12: 4 of the 8 running have left it already.
    assert hold.slots(NOW, starts[4:], BUDGET, free_slots=8, backend_slots=12) == \
        hold.slots(NOW, starts, BUDGET, free_slots=8, backend_slots=12)
    # It reports all 16 free: the 8 runs have left it, none ends ahead, and
    # one slot is kept for an arrival now.
    assert hold.slots(NOW, starts, BUDGET, free_slots=16, backend_slots=16) == 1
    assert ArrivalsHold(max_share=0.0).slots(NOW, starts, BUDGET, **room) == 0
    assert math.isclose(expected_arrivals(0.0, 5.0), 1.0)
