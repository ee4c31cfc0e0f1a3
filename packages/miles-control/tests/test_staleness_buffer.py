"""The fully_async staleness rule under random stage timings (property tests) and by hand."""

import heapq
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_control.job.runtime.buffer import Group, StalenessBuffer


def test_take_skips_and_counts_stale_groups_by_hand():
    buf = StalenessBuffer(capacity=8)
    for gid, versions in enumerate([[0], [1], [1, 2], [2], [3]]):
        buf.put(Group(gid, prompt=gid, samples=[], versions=versions))
    taken = buf.take(3, trainer_version=3, max_staleness=1)
    # staleness = 3 − oldest version: 3, 2, 2 (a group spanning versions 1 and 2 counts as 1), 1, 0
    assert [g.group_id for g in taken.groups] == [3, 4]
    assert [g.group_id for g in taken.dropped] == [0, 1, 2]
    assert buf.num_dropped == 3 and len(buf) == 0


def test_regenerate_policy_hands_prompts_back():
    buf = StalenessBuffer(capacity=2)
    buf.put(Group(0, prompt="p0", samples=[], versions=[0]))
    buf.put(Group(1, prompt="p1", samples=[], versions=[5]))
    taken = buf.take(2, trainer_version=5, max_staleness=2, policy="regenerate")
    assert [g.prompt for g in taken.regenerate] == ["p0"] and [g.group_id for g in taken.groups] == [1]
    assert buf.num_regenerated == 1


def test_put_waits_for_room_and_take_waits_for_groups():
    buf = StalenessBuffer(capacity=1)
    buf.put(Group(0, None, [], [0]))
    assert not buf.put(Group(1, None, [], [0]), timeout=0.05)  # full
    got = {}
    taker = threading.Thread(target=lambda: got.setdefault("t", buf.take(2, 0, 0, timeout=5)))
    taker.start()
    assert buf.put(Group(1, None, [], [0]), timeout=5)  # the taker made room
    taker.join(5)
    assert [g.group_id for g in got["t"].groups] == [0, 1]
    with pytest.raises(ValueError, match="at least 1"):
        StalenessBuffer(0)


def simulate(gen_times, train_times, push_time, interval, max_staleness, capacity, batch_groups, policy):
    """Discrete-event run of fully_async with one generator and one trainer, using the real buffer.

    Returns per train step the (group id, staleness at take) of what it trained on, and all dropped ids.
    """
    buf = StalenessBuffer(capacity)
    engine_version = trainer_version = 0
    events: list[tuple[float, int, str]] = []
    seq = 0

    def at(time, kind):
        nonlocal seq
        seq += 1
        heapq.heappush(events, (time, seq, kind))

    gen_i = 0
    regen: list = []
    current = None  # the group being generated: its id and the versions it spans
    next_id = 0
    pending: list[Group] = []
    trained: list[list[tuple[int, int]]] = []
    dropped: list[int] = []
    trainer_busy = False
    blocked_group = None

    def start_generation(now):
        nonlocal gen_i, current, next_id
        prompt = regen.pop(0) if regen else ("prompt", next_id)
        current = Group(next_id, prompt, [], [engine_version])
        next_id += 1
        at(now + gen_times[gen_i % len(gen_times)], "generated")
        gen_i += 1

    def try_train(now):
        nonlocal trainer_busy
        if trainer_busy:
            return
        got = buf.take(batch_groups - len(pending), trainer_version, max_staleness, policy)
        pending.extend(got.groups)
        dropped.extend(g.group_id for g in got.dropped + got.regenerate)
        regen.extend(g.prompt for g in got.regenerate)
        if len(pending) == batch_groups:
            trained.append([(g.group_id, g.staleness(trainer_version)) for g in pending])
            pending.clear()
            trainer_busy = True
            at(now + train_times[len(trained) % len(train_times)], "trained")

    start_generation(0.0)
    steps = 0
    while steps < 12:
        now, _, kind = heapq.heappop(events)
        if kind == "generated":
            if buf.put(current, timeout=0):
                start_generation(now)
            else:
                blocked_group = current  # waits for room
        elif kind == "trained":
            trainer_version += 1
            steps += 1
            if trainer_version % interval == 0:
                at(now + push_time, "pushed")
                continue
            trainer_busy = False
        elif kind == "pushed":
            engine_version = trainer_version
            if current is not None and blocked_group is None:
                current.versions.append(engine_version)  # a group in flight spans the push
            trainer_busy = False
        try_train(now)
        if blocked_group is not None and buf.put(blocked_group, timeout=0):
            blocked_group = None
            start_generation(now)
        try_train(now)
    return trained, dropped


timings = st.lists(st.floats(min_value=0.01, max_value=5.0), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(
    gen_times=timings,
    train_times=timings,
    push_time=st.floats(min_value=0.0, max_value=3.0),
    interval=st.integers(1, 3),
    extra_staleness=st.integers(0, 2),
    capacity=st.integers(1, 6),
    batch_groups=st.integers(1, 4),
    policy=st.sampled_from(["drop", "regenerate"]),
)
def test_staleness_bound_holds_and_nothing_is_trained_twice(
    gen_times, train_times, push_time, interval, extra_staleness, capacity, batch_groups, policy
):
    max_staleness = interval - 1 + extra_staleness  # the smallest bound that cannot starve the trainer
    trained, dropped = simulate(
        gen_times, train_times, push_time, interval, max_staleness, capacity, batch_groups, policy
    )
    assert len(trained) == 12
    ids = [gid for step in trained for gid, _ in step]
    assert len(ids) == len(set(ids)), "a group was trained on twice"
    assert not set(ids) & set(dropped), "a dropped group was trained on"
    assert all(0 <= s <= max_staleness for step in trained for _, s in step)
