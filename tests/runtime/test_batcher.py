"""The dynamic batcher on its own, without a model: every caller gets exactly its own result under
contention, groups respect is_full and the delay, one call's error stays its own, a failing group fails
only its callers, and close() releases the queue without leaving a thread blocked.

Timing assertions are lower bounds with generous upper bounds, so a loaded machine slows these tests
but never fails them; waits for a state use events, and every join has a timeout, so a bug shows as a
failure rather than a hang."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from optimum_ipu_backend.errors import DeviceError
from optimum_ipu_backend.runtime.batcher import BatcherClosedError, DynamicBatcher, Pending

JOIN_S = 10.0  # generous: no test should come near it


def _start(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def _join_all(threads: list[threading.Thread]) -> None:
    deadline = time.monotonic() + JOIN_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not [thread for thread in threads if thread.is_alive()], "a thread was left blocked"


def _wait_for(predicate, what: str) -> None:
    # Test-side only: the batcher has no hook to wait on for "a call is queued".
    deadline = time.monotonic() + JOIN_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.002)


def _submit_into(batcher: DynamicBatcher, item, outcomes: dict, key) -> None:
    try:
        outcomes[key] = ("result", batcher.submit(item))
    except BaseException as error:
        outcomes[key] = ("error", error)


def _queue_in_turn(batcher: DynamicBatcher, items, outcomes: dict, threads: list) -> None:
    """Submit each item from a thread of its own, each once the one before is queued (arrival order
    fixed), while the worker is busy with an earlier group."""
    for item in items:
        before = batcher.statistics["queued"]
        threads.append(_start(_submit_into, batcher, item, outcomes, item))
        _wait_for(lambda before=before: batcher.statistics["queued"] == before + 1, f"{item!r} is queued")


def _blocked_batcher(max_delay_s: float = 0.0, cap: int = 4):
    """A batcher whose first group blocks in run_group until `release` is set, so later calls queue."""
    running, release = threading.Event(), threading.Event()
    groups: list[list] = []

    def run_group(items):
        groups.append(list(items))
        if items[0] == "block":
            running.set()
            assert release.wait(JOIN_S)
        return [f"done {item}" for item in items]

    batcher = DynamicBatcher(run_group, max_delay_s=max_delay_s, is_full=lambda items: len(items) >= cap)
    return batcher, running, release, groups


def test_sixteen_threads_each_get_exactly_their_own_results():
    cap = 6
    sizes: list[int] = []
    sizes_lock = threading.Lock()

    def value(item):
        thread, i, payload = item
        return np.arange(4, dtype=np.float64) * payload + thread * 1000 + i

    def run_group(items):
        with sizes_lock:
            sizes.append(len(items))
        time.sleep(0.001)  # a device step takes time; callers arrive meanwhile
        return [value(item) for item in items]

    batcher = DynamicBatcher(run_group, max_delay_s=0.005, is_full=lambda items: len(items) >= cap)
    mismatches: list = []
    errors: list = []

    def client(thread: int) -> None:
        rng = random.Random(thread)
        try:
            for i in range(50):
                item = (thread, i, rng.random())
                got = batcher.submit(item)
                if not np.array_equal(got, value(item)):
                    mismatches.append((item, got))
        except BaseException as error:
            errors.append(error)

    threads = [_start(client, thread) for thread in range(16)]
    _join_all(threads)
    batcher.close()
    assert not errors and not mismatches
    assert sum(sizes) == 16 * 50
    assert max(sizes) > 1, "no two calls were ever batched"
    assert max(sizes) <= cap
    stats = batcher.statistics
    assert stats["items_run"] == 800 and stats["groups_run"] == len(sizes) and stats["items_failed"] == 0
    assert stats["largest_group"] == max(sizes) and stats["queued"] == 0


def test_group_is_the_prefix_up_to_the_first_full_one():
    # is_full counts "tokens": 3 + 4 = 7 is not full, 3 + 4 + 5 = 12 is; so the group is [3, 4, 5] even
    # though 5 overflows a budget of 10: the caller's is_full decides, on the group with the item added.
    batcher, running, release, groups = _blocked_batcher()
    seen: list[list] = []

    def is_full(items):
        seen.append(list(items))
        return items == ["block"] or sum(item for item in items if item != "block") >= 10

    batcher._is_full = is_full
    outcomes: dict = {}
    threads = [_start(_submit_into, batcher, "block", outcomes, "block")]
    assert running.wait(JOIN_S)
    _queue_in_turn(batcher, (3, 4, 5, 1), outcomes, threads)
    release.set()
    _join_all(threads)
    batcher.close()
    assert groups == [["block"], [3, 4, 5], [1]]
    assert [3, 4, 5, 1] not in seen
    assert {key: outcome for key, outcome in outcomes.items()} == {
        key: ("result", f"done {key}") for key in ("block", 3, 4, 5, 1)
    }


def _in_order(fits):
    """A ``choose`` for the batcher: in arrival order, the items that still ``fits`` the group (the oldest
    always)."""

    def choose(items):
        taken: list[int] = []
        for index, item in enumerate(items):
            if not taken or fits([*(items[i] for i in taken), item]):
                taken.append(index)
        return taken

    return choose


def test_with_fits_a_group_takes_the_items_that_fit_and_the_others_wait_in_order():
    # a step of 10 "tokens": behind 3 and 8, the 8 waits while 4 and 2 fill the step; it leads the next
    batcher, running, release, groups = _blocked_batcher(cap=100)
    batcher._choose = _in_order(lambda items: sum(item for item in items if item != "block") <= 10)
    outcomes: dict = {}
    threads = [_start(_submit_into, batcher, "block", outcomes, "block")]
    assert running.wait(JOIN_S)
    _queue_in_turn(batcher, (3, 8, 4, 2, 6), outcomes, threads)
    release.set()
    _join_all(threads)
    batcher.close()
    assert groups == [["block"], [3, 4, 2], [8], [6]]
    assert outcomes == {key: ("result", f"done {key}") for key in ("block", 3, 8, 4, 2, 6)}


def test_outstanding_counts_the_calls_queued_and_running_between_two_groups():
    """1 call running and 5 queued behind it: the group formed next reports 6 callers outstanding."""
    batcher, running, release, groups = _blocked_batcher(cap=100)
    seen: list[int] = []
    inner = batcher._run_group

    def run_group(items):
        seen.append(batcher.outstanding)
        return inner(items)

    batcher._run_group = run_group
    outcomes: dict = {}
    threads = [_start(_submit_into, batcher, "block", outcomes, "block")]
    assert running.wait(JOIN_S)
    _queue_in_turn(batcher, (1, 2, 3, 4, 5), outcomes, threads)
    release.set()
    _join_all(threads)
    batcher.close()
    assert groups == [["block"], [1, 2, 3, 4, 5]]
    assert seen == [1, 6]


def test_a_call_left_queued_waits_the_delay_for_the_callers_just_answered():
    """A step of 10: 6 runs, 7 is left queued; 6's caller calls again at once with 3, which joins 7 within
    the delay counted from 6's delivery, instead of 7 running alone."""
    batcher, running, release, groups = _blocked_batcher(max_delay_s=0.5, cap=100)
    batcher._choose = _in_order(lambda items: sum(item for item in items if item != "block") <= 10)
    outcomes: dict = {}

    def six_then_three() -> None:
        _submit_into(batcher, 6, outcomes, 6)
        _submit_into(batcher, 3, outcomes, 3)

    threads = [_start(_submit_into, batcher, "block", outcomes, "block")]
    assert running.wait(JOIN_S)
    threads.append(_start(six_then_three))
    _wait_for(lambda: batcher.statistics["queued"] == 1, "6 is queued")
    _queue_in_turn(batcher, (7,), outcomes, threads)
    release.set()
    _join_all(threads)
    batcher.close()
    assert groups == [["block"], [6], [7, 3]]
    assert outcomes == {key: ("result", f"done {key}") for key in ("block", 6, 7, 3)}


def test_a_skipped_call_waits_for_the_callers_just_answered_before_its_group_counts_as_full():
    """A step of 10: 5 and 4 run, 8 is left queued; their callers come back with 3 (too long beside 8)
    at once and with 2 after 0.2 s. The group of 8 waits for the second caller, whose 2 fills the step,
    instead of running 8 alone as soon as the 3 was skipped."""
    batcher, running, release, groups = _blocked_batcher(max_delay_s=1.0, cap=100)
    batcher._choose = _in_order(lambda items: sum(item for item in items if item != "block") <= 10)
    outcomes: dict = {}

    def caller(first, again, pause_s) -> None:
        _submit_into(batcher, first, outcomes, first)
        time.sleep(pause_s)
        _submit_into(batcher, again, outcomes, again)

    threads = [_start(_submit_into, batcher, "block", outcomes, "block")]
    assert running.wait(JOIN_S)
    for first, again, pause_s in ((5, 3, 0.0), (4, 2, 0.2)):
        before = batcher.statistics["queued"]
        threads.append(_start(caller, first, again, pause_s))
        _wait_for(lambda before=before: batcher.statistics["queued"] == before + 1, f"{first} is queued")
    _queue_in_turn(batcher, (8,), outcomes, threads)
    release.set()
    _join_all(threads)
    batcher.close()
    assert groups == [["block"], [5, 4], [8, 2], [3]]
    assert outcomes == {key: ("result", f"done {key}") for key in ("block", 5, 4, 8, 3, 2)}


def test_an_item_marked_invalid_fails_only_its_caller():
    class BadItem(ValueError):
        pass

    def run_group(items):
        return [BadItem(f"item {item} is invalid") if item % 5 == 0 else item * 2 for item in items]

    batcher = DynamicBatcher(run_group, max_delay_s=0.05, is_full=lambda items: len(items) >= 10)
    outcomes: dict = {}
    threads = [_start(_submit_into, batcher, item, outcomes, item) for item in range(1, 11)]
    _join_all(threads)
    batcher.close()
    assert batcher.statistics["largest_group"] > 1  # the bad items shared groups with good ones
    for item in range(1, 11):
        kind, value = outcomes[item]
        if item % 5 == 0:
            assert kind == "error" and isinstance(value, BadItem) and str(value) == f"item {item} is invalid"
            # raised in the caller's thread, with a traceback through submit
            assert value.__traceback__ is not None
        else:
            assert (kind, value) == ("result", item * 2)
    assert batcher.statistics["items_failed"] == 2


def test_run_group_raising_fails_its_group_and_later_groups_work():
    batcher, running, release, groups = _blocked_batcher(cap=3)

    def run_group(items):
        groups.append(list(items))
        if "block" in items:
            running.set()
            assert release.wait(JOIN_S)
            return ["done block"]
        if "boom" in items:
            raise DeviceError(f"the device refused a group of {len(items)}")
        return [f"done {item}" for item in items]

    batcher._run_group = run_group
    outcomes: dict = {}
    threads = [_start(_submit_into, batcher, "block", outcomes, "block")]
    assert running.wait(JOIN_S)
    # one full group of 3, containing the item that breaks it
    _queue_in_turn(batcher, ("a", "boom", "c"), outcomes, threads)
    release.set()
    _join_all(threads)
    assert groups[1] == ["a", "boom", "c"]
    raised = [outcomes[item][1] for item in ("a", "boom", "c")]
    for error in raised:
        assert isinstance(error, DeviceError) and str(error) == "the device refused a group of 3"
        # each caller has its own copy, chained to the one run_group raised (with run_group's frames)
        assert error.__cause__ is raised[0].__cause__ and error.__cause__ is not error
        assert error.__cause__.__traceback__ is not None
    assert len({id(error) for error in raised}) == 3
    assert batcher.submit("later") == "done later"
    stats = batcher.statistics
    assert stats["groups_failed"] == 1 and stats["items_failed"] == 3
    batcher.close()


def test_a_group_of_one_raises_the_exception_itself():
    error = KeyError("the one")

    def run_group(items):
        raise error

    batcher = DynamicBatcher(run_group, max_delay_s=0, is_full=lambda items: True)
    with pytest.raises(KeyError) as raised:
        batcher.submit(1)
    assert raised.value is error
    batcher.close()


def test_an_exception_that_cannot_be_copied_is_shared():
    class Stubborn(Exception):
        def __init__(self, code: int, *, where: str) -> None:  # copy.copy calls cls(*args): no `where`
            super().__init__(code)

    batcher, running, release, _ = _blocked_batcher(cap=2)
    original = batcher._run_group

    def run_group(items):
        if "block" in items:
            return original(items)
        raise Stubborn(7, where="device")

    batcher._run_group = run_group
    outcomes: dict = {}
    threads = [_start(_submit_into, batcher, "block", outcomes, "block")]
    assert running.wait(JOIN_S)
    _queue_in_turn(batcher, ("x", "y"), outcomes, threads)
    release.set()
    _join_all(threads)
    batcher.close()
    assert outcomes["x"][1] is outcomes["y"][1] and isinstance(outcomes["x"][1], Stubborn)


@pytest.mark.parametrize(
    "returned", [lambda items: items[:-1], lambda items: items + ["extra"], lambda _: None]
)
def test_a_wrong_number_of_results_fails_every_caller(returned):
    batcher, running, release, _ = _blocked_batcher(cap=3)
    original = batcher._run_group
    batcher._run_group = lambda items: original(items) if "block" in items else returned(list(items))
    outcomes: dict = {}
    threads = [_start(_submit_into, batcher, "block", outcomes, "block")]
    assert running.wait(JOIN_S)
    _queue_in_turn(batcher, ("a", "b", "c"), outcomes, threads)
    release.set()
    _join_all(threads)
    batcher.close()
    assert outcomes["block"] == ("result", "done block")
    for item in ("a", "b", "c"):
        kind, error = outcomes[item]
        assert kind == "error" and type(error) is RuntimeError
        assert "for a group of 3 calls" in str(error) and "by position" in str(error)


def test_close_releases_queued_calls_and_lets_the_running_group_finish():
    batcher, running, release, groups = _blocked_batcher(max_delay_s=30.0, cap=2)
    outcomes: dict = {}
    # "block" and "partner" form a full group that blocks in run_group; the rest queue behind it.
    threads = [_start(_submit_into, batcher, "block", outcomes, "block")]
    _wait_for(lambda: batcher.statistics["queued"] == 1, "block is queued")
    threads.append(_start(_submit_into, batcher, "partner", outcomes, "partner"))
    assert running.wait(JOIN_S)
    for item in range(5):
        threads.append(_start(_submit_into, batcher, item, outcomes, item))
    _wait_for(lambda: batcher.statistics["queued"] == 5, "five calls are queued")

    closer = _start(batcher.close)  # waits for the running group
    _wait_for(lambda: batcher.closed, "close() began")
    with pytest.raises(BatcherClosedError):  # refused at once, while the running group still runs
        batcher.submit("late")
    release.set()
    _join_all([*threads, closer])
    assert outcomes["block"] == ("result", "done block") and outcomes["partner"] == ("result", "done partner")
    for item in range(5):
        kind, error = outcomes[item]
        assert kind == "error" and isinstance(error, BatcherClosedError) and isinstance(error, DeviceError)
        assert "closed while this call waited in the dynamic batcher" in str(error)
    assert groups == [["block", "partner"]]  # nothing queued was run after close
    assert batcher.statistics["items_released_on_close"] == 5 and batcher.statistics["queued"] == 0
    assert not batcher._worker.is_alive()
    batcher.close()  # twice is fine
    with pytest.raises(BatcherClosedError, match="was closed"):
        batcher.submit("after")


def test_close_from_inside_run_group_does_not_deadlock():
    holder: list[DynamicBatcher] = []

    def run_group(items):
        holder[0].close()
        return [item + 1 for item in items]

    batcher = DynamicBatcher(run_group, max_delay_s=0, is_full=lambda items: True)
    holder.append(batcher)
    outcome: dict = {}
    _join_all([_start(_submit_into, batcher, 1, outcome, "only")])
    assert outcome["only"] == ("result", 2)
    batcher._worker.join(JOIN_S)
    assert not batcher._worker.is_alive()
    with pytest.raises(BatcherClosedError):
        batcher.submit(2)


def test_submit_from_inside_run_group_raises_instead_of_waiting_for_itself():
    holder: list[DynamicBatcher] = []

    def run_group(items):
        return [holder[0].submit("nested")]

    batcher = DynamicBatcher(run_group, max_delay_s=0, is_full=lambda items: True)
    holder.append(batcher)
    with pytest.raises(RuntimeError, match="would wait for the thread that must run it"):
        batcher.submit(1)
    batcher.close()


def test_close_of_an_unused_batcher_and_submit_racing_with_close_never_hang():
    DynamicBatcher(lambda items: items, max_delay_s=0, is_full=lambda items: True).close()
    for _ in range(20):
        batcher = DynamicBatcher(lambda items: list(items), max_delay_s=0.001, is_full=lambda items: False)
        outcomes: dict = {}
        threads = [_start(_submit_into, batcher, item, outcomes, item) for item in range(4)]
        batcher.close()
        _join_all(threads)
        for item, (kind, value) in outcomes.items():
            assert (kind, value) == ("result", item) or isinstance(value, BatcherClosedError)


def _closed_loop(batcher: DynamicBatcher, callers: int, rounds, turnaround_s) -> list[threading.Thread]:
    """Callers that each submit (caller, round) for their rounds, waiting turnaround_s(caller) between
    an answer and their next call, as a client thread preparing its next request does."""

    def caller(index: int) -> None:
        for round_ in range(rounds(index)):
            if round_:
                time.sleep(turnaround_s(index))
            assert batcher.submit((index, round_)) == (index, round_)

    return [_start(caller, index) for index in range(callers)]


def _first_group_full_at(size: int, max_delay_s: float) -> tuple[DynamicBatcher, list[list]]:
    """A batcher whose first group is full at ``size`` items (nothing is known of the callers yet) and
    whose later groups never are, and the groups it runs (each sorted)."""
    groups: list[list] = []
    first = threading.Event()

    def run_group(items):
        groups.append(sorted(items))
        first.set()
        return list(items)

    full = lambda items: not first.is_set() and len(items) >= size  # noqa: E731
    return DynamicBatcher(run_group, max_delay_s=max_delay_s, is_full=full), groups


def test_once_every_known_caller_is_queued_the_group_runs_without_waiting_out_the_delay():
    """4 callers that wait for their answers come back 0 to 60 ms apart: each later round runs as one
    group once the fourth is back, long before the 30 s delay (nobody else can join it)."""
    batcher, groups = _first_group_full_at(4, max_delay_s=30.0)
    start = time.monotonic()
    _join_all(_closed_loop(batcher, 4, rounds=lambda index: 3, turnaround_s=lambda index: 0.02 * index))
    elapsed = time.monotonic() - start
    batcher.close()
    assert groups == [[(index, round_) for index in range(4)] for round_ in range(3)]
    assert batcher.statistics["groups_all_callers"] == 2
    assert elapsed < 5.0  # each round waited for its slowest caller (60 ms), never for the 30 s delay


def test_a_known_caller_that_does_not_come_back_leaves_the_others_to_the_delay():
    """3 callers ran together; only 2 call again: their group waits out the delay, since the third
    could still have joined it."""
    batcher, groups = _first_group_full_at(3, max_delay_s=0.3)
    start = time.monotonic()
    _join_all(
        _closed_loop(batcher, 3, rounds=lambda index: 1 if index == 2 else 2, turnaround_s=lambda index: 0)
    )
    elapsed = time.monotonic() - start
    batcher.close()
    assert elapsed >= 0.3
    assert groups == [[(0, 0), (1, 0), (2, 0)], [(0, 1), (1, 1)]]
    assert batcher.statistics["groups_all_callers"] == 0


def test_callers_stay_known_through_a_pause_so_the_first_call_after_it_waits_for_them():
    """4 callers ran together, then one alone for two groups (the end of a burst). When all 4 come back,
    the first one back waits, within the delay, for the other 3, instead of running alone: the callers
    are known from the last KNOWN_WINDOWS windows, not from the pause."""
    batcher, groups = _first_group_full_at(4, max_delay_s=0.5)
    threads = [_start(batcher.submit, (index, 0)) for index in range(4)]
    _join_all(threads)
    for round_ in (1, 2):
        assert batcher.submit((0, round_)) == (0, round_)
    first = _start(batcher.submit, (0, 3))
    _wait_for(lambda: batcher.statistics["queued"] == 1, "the first caller is back")
    time.sleep(0.05)
    threads = [first, *(_start(batcher.submit, (index, 1)) for index in (1, 2, 3))]
    _join_all(threads)
    batcher.close()
    assert groups[:3] == [[(index, 0) for index in range(4)], [(0, 1)], [(0, 2)]]
    assert groups[3:] == [[(0, 3), (1, 1), (2, 1), (3, 1)]]


def test_the_delay_is_honoured():
    batcher = DynamicBatcher(
        lambda items: list(items), max_delay_s=0.05, is_full=lambda items: len(items) >= 8
    )
    start = time.monotonic()
    assert batcher.submit("alone") == "alone"
    assert 0.05 <= time.monotonic() - start < 5.0
    batcher.close()


def test_a_full_group_does_not_wait_for_the_delay():
    batcher = DynamicBatcher(lambda items: list(items), max_delay_s=30.0, is_full=lambda items: True)
    start = time.monotonic()
    assert batcher.submit("alone") == "alone"
    assert time.monotonic() - start < 5.0
    batcher.close()


def test_zero_delay_runs_what_is_queued_without_waiting():
    batcher, running, release, groups = _blocked_batcher(max_delay_s=0.0, cap=100)
    outcomes: dict = {}
    threads = [_start(_submit_into, batcher, "block", outcomes, "block")]
    assert running.wait(JOIN_S)
    for item in range(3):
        threads.append(_start(_submit_into, batcher, item, outcomes, item))
    _wait_for(lambda: batcher.statistics["queued"] == 3, "three calls are queued")
    release.set()
    _join_all(threads)
    start = time.monotonic()
    assert batcher.submit("next") == "done next"
    assert time.monotonic() - start < 5.0
    batcher.close()
    assert sorted(groups[1]) == [0, 1, 2]  # what was queued went as one group, no delay to wait out


def test_is_full_raising_fails_its_group_and_the_worker_keeps_serving():
    def is_full(items):
        if "bad" in items:
            raise ZeroDivisionError("is_full broke")
        return True

    batcher = DynamicBatcher(lambda items: list(items), max_delay_s=0, is_full=is_full)
    with pytest.raises(ZeroDivisionError, match="is_full broke"):
        batcher.submit("bad")
    assert batcher.submit("good") == "good"
    assert batcher.statistics["batcher_errors"] == 1
    batcher.close()


def test_an_interrupted_caller_leaves_the_queue_consistent(monkeypatch):
    batcher, running, release, groups = _blocked_batcher(max_delay_s=0.0, cap=100)
    outcomes: dict = {}
    threads = [_start(_submit_into, batcher, "block", outcomes, "block")]
    assert running.wait(JOIN_S)

    real_wait = Pending._wait

    def interrupted_wait(self):
        if self.item == "queued":  # interrupted while still in the queue
            raise KeyboardInterrupt
        if self.item == "handed":  # interrupted after run_group took it
            _wait_for(lambda: groups[-1] == ["handed"], "run_group has the call")
            raise KeyboardInterrupt
        real_wait(self)

    monkeypatch.setattr(Pending, "_wait", interrupted_wait)
    with pytest.raises(KeyboardInterrupt):
        batcher.submit("queued")
    assert batcher.statistics["queued"] == 0
    release.set()
    _join_all(threads)
    with pytest.raises(KeyboardInterrupt):
        batcher.submit("handed")
    assert batcher.submit("after") == "done after"
    batcher.close()
    assert all("queued" not in group for group in groups)  # removed from the queue, never run
    assert batcher.statistics["items_abandoned"] == 1


@pytest.mark.parametrize("delay", [-1.0, float("nan"), float("inf")])
def test_a_bad_delay_is_refused(delay):
    with pytest.raises(ValueError, match="finite number of seconds"):
        DynamicBatcher(lambda items: items, max_delay_s=delay, is_full=lambda items: True)
