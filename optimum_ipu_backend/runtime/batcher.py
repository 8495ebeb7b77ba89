"""A generic dynamic batcher: calls from many threads gathered into one device step.

Triton-style dynamic batching for a session: each ``submit`` queues one call and blocks its thread; one
worker thread takes the oldest queued call, waits until ``max_delay_s`` after that call was submitted (or
after the previous group was delivered, if later), until the group is full, or until every caller it
knows of has a call queued, whichever comes first, and hands the group to ``run_group`` once. Counting the
delay from the last delivery too lets the callers just answered, who call again at once, join the calls
left queued, instead of those running alone in a step they cannot fill: each call still waits at most
``max_delay_s`` once the device is free for it. The callers it knows of are the most calls outstanding at
once (queued or running) in the last ``KNOWN_WINDOWS`` windows between groups: once all of them are queued
no other call can join (callers that wait for their answers), so waiting longer would only delay them.
What an item is and when a group is full (rows of a device step, tokens of packed rows) is the caller's
business; this module only keeps the queue, so it is tested without any model and knows nothing of
sessions.

Guarantees:

- Groups are the longest prefix of the queue, in arrival order, whose shorter prefixes are not full:
  items are added until ``is_full(group)`` is true (``is_full`` sees a fresh list each time). An item
  that alone makes a group full is run alone. With ``choose(items)``, a group takes only the queue
  positions it returns (the calls that fill a packed step best), in arrival order, the oldest always;
  an item left out stays queued, ahead of later ones, and the group counts as full once as many calls
  have arrived since the last group was formed as that group held (the callers it answered are back, or
  calls come faster than groups run); until then it waits, within the delay, for calls that fill the
  room left. The oldest item always runs, so one left out waits for at most as many groups as there
  are items ahead of it. ``max_delay_s == 0`` waits for nothing beyond what is already queued.
- ``run_group`` returns one entry per item, in order: a result, or an exception instance for that item
  alone, which is raised in that caller's thread. If ``run_group`` raises, every caller of the group
  raises: a group of one raises the exception itself; in a larger group each caller raises its own
  shallow copy (same type, ``args`` and attributes) whose ``__cause__`` is the exception ``run_group``
  raised, with ``run_group``'s traceback, so that concurrent raises never splice callers' frames into
  one shared traceback. An exception that cannot be copied faithfully is raised as the same object in
  every caller. If ``run_group`` returns a wrong number of entries, every caller gets a ``RuntimeError``
  that says so: results are never assigned by guesswork.
- An exception in the batcher's own code, or in ``is_full``, fails the callers of the group it hit
  (as ``run_group`` raising would) and the worker keeps serving.
- ``close()``: later submits raise ``BatcherClosedError`` at once; queued calls not yet handed to
  ``run_group`` are released with ``BatcherClosedError``; a group already running completes and its
  callers get their results; ``close`` then joins the worker (bounded). Called from inside ``run_group``
  or ``is_full`` (the worker thread itself) it does not join: the worker exits once the running group
  is delivered. A submit racing with close is either queued before close (and then run or released) or
  refused; none waits forever.
- A caller interrupted while it waits (``KeyboardInterrupt`` or any exception raised in its wait) leaves
  the queue consistent, best effort: if its call is still queued it is removed and never run; if it was
  already handed to ``run_group`` the group runs as planned and that caller's result is dropped
  (counted as ``items_abandoned``).
- ``submit`` from the worker thread (inside ``run_group`` or ``is_full``) raises ``RuntimeError``
  rather than waiting for itself.

One ``threading.Condition`` guards the queue; each call waits on its own ``threading.Event``, so a group
wakes exactly its callers. Nothing polls: the worker sleeps on the condition with the time left until
the oldest call's deadline.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from optimum_ipu_backend.errors import ConfigurationError, DeviceError

__all__ = ["CLOSE_TIMEOUT_S", "BatcherClosedError", "DynamicBatcher", "Pending"]

_logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

#: Callers are known from the most calls outstanding in this many windows between groups: a pause in the
#: traffic (the end of a burst) lowers that count for a window or two, and the first calls after it
#: would otherwise run alone before the other callers are back. A caller count that really fell costs
#: each call at most the delay, for this many groups.
KNOWN_WINDOWS = 16

#: How long ``close()`` waits by default for the group already running (a device step, which may
#: include a compile) before it returns and leaves the worker to finish that group alone.
CLOSE_TIMEOUT_S = 60.0

_CLOSED_WHILE_QUEUED = (
    "the session was closed while this call waited in the dynamic batcher; it was never run. "
    "Create a new session to run again"
)
_CLOSED_BEFORE_SUBMIT = "the session's dynamic batcher was closed; create a new session to run again"


class BatcherClosedError(DeviceError):
    """A call reached a session's dynamic batcher after the session was closed, or waited in its queue
    when the session was closed; the call was not run."""


@dataclass(eq=False)  # identity equality: the queue removes exactly this call, never an equal one
class Pending(Generic[T]):
    """One queued call: the item its caller submitted (opaque to the batcher) and the slot its outcome
    is delivered to."""

    item: T
    submitted_at: float = field(default_factory=time.monotonic)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _result: Any = field(default=None, repr=False)
    _error: BaseException | None = field(default=None, repr=False)

    def _wait(self) -> None:
        # A method of its own so that tests can interrupt a caller's wait deterministically.
        self._done.wait()

    def _deliver(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._done.set()

    def _outcome(self) -> Any:
        error = self._error
        if error is None:
            result, self._result = self._result, None
            return result
        self._error = None  # the caller's traceback holds its frame; drop the cycle through this slot
        try:
            raise error
        finally:
            del error


def _for_each_caller(error: BaseException, count: int) -> list[BaseException]:
    """One exception per caller of a group that failed as a whole: the error itself for a group of
    one; otherwise shallow copies chained to it (see the module docstring), or the error itself for
    every caller if its type cannot be copied faithfully."""
    if count == 1:
        return [error]
    copies: list[BaseException] = []
    for _ in range(count):
        try:
            twin = copy.copy(error)
        except Exception:
            return [error] * count
        if type(twin) is not type(error) or twin.args != error.args:
            return [error] * count
        twin.__traceback__ = None
        twin.__cause__ = error
        copies.append(twin)
    return copies


class DynamicBatcher(Generic[T, R]):
    """Gathers ``submit`` calls from many threads into groups and runs each group with one
    ``run_group`` call on a worker thread (see the module docstring for the guarantees).

    ``run_group(items)`` returns one result or exception instance per item, in order. ``is_full(items)``
    says whether a candidate group is full; it is called under the batcher's lock, so it must be cheap
    and must not call into the batcher. ``max_delay_s`` is how long the oldest queued call may wait for
    others to join it.
    """

    def __init__(
        self,
        run_group: Callable[[list[T]], list[R | BaseException]],
        *,
        max_delay_s: float,
        is_full: Callable[[list[T]], bool],
        name: str = "ipu-batcher",
        choose: Callable[[list[T]], list[int]] | None = None,
    ) -> None:
        if not (isinstance(max_delay_s, (int, float)) and math.isfinite(max_delay_s) and max_delay_s >= 0):
            raise ConfigurationError(
                f"the dynamic batcher's delay must be a finite number of seconds >= 0, got {max_delay_s!r}"
            )
        self._run_group = run_group
        self._is_full = is_full
        self._choose = choose
        self._max_delay_s = float(max_delay_s)
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[Pending[T]] = deque()
        self._closed = False
        self._worker: threading.Thread | None = None
        self._scanned: list[int] = []  # queue positions _group_size chose so far; the group if it raises
        self._running = 0  # calls of the group being run
        self._delivered_at = 0.0  # when the last group's callers got their outcomes (monotonic)
        self._peak = 0  # most calls outstanding (queued or running) at once since the last group was formed
        self._formed_peak = 0  # that figure for the window that ended when the running group was formed
        self._window_peaks: deque[int] = deque(maxlen=KNOWN_WINDOWS)  # it, for the last windows
        self._arrived = 0  # calls submitted since the last group was formed
        self._last_taken = 0  # calls in the last group formed
        self._stats = {
            "groups_run": 0,  # run_group calls
            "groups_full": 0,  # of those, run because is_full said so, or an item was left out (choose)
            "groups_all_callers": 0,  # of the others, run early because every caller known was queued
            "groups_failed": 0,  # run_group (or the batcher while forming the group) raised
            "items_run": 0,  # items handed to run_group
            "items_failed": 0,  # callers that got an exception from their group
            "items_released_on_close": 0,  # queued calls released with BatcherClosedError
            "items_abandoned": 0,  # callers that stopped waiting (interrupted) before their outcome
            "largest_group": 0,
            "batcher_errors": 0,  # unexpected exceptions in the batcher's own code or is_full
        }

    # -- callers' side -----------------------------------------------------------------------------

    def submit(self, item: T) -> R:
        """Queue ``item``, wait until its group has run, and return its result or raise its exception
        (``BatcherClosedError`` if the batcher is or gets closed before the call is run)."""
        pending: Pending[T] = Pending(item)
        with self._cond:
            if self._closed:
                raise BatcherClosedError(_CLOSED_BEFORE_SUBMIT)
            if self._worker is not None and threading.current_thread() is self._worker:
                raise RuntimeError(
                    f"submit() was called from inside {self._name}'s run_group or is_full; the call "
                    "would wait for the thread that must run it"
                )
            self._queue.append(pending)
            self._arrived += 1
            self._peak = max(self._peak, len(self._queue) + self._running)
            self._start_worker()
            self._cond.notify_all()
        try:
            pending._wait()
        except BaseException:
            self._forget(pending)
            raise
        return pending._outcome()

    def _forget(self, pending: Pending[T]) -> None:
        """A caller stopped waiting: take its call out of the queue, or mark its outcome to be dropped."""
        with self._cond:
            try:
                self._queue.remove(pending)
            except ValueError:
                # already handed to run_group (or released by close): the group runs as planned and
                # this caller's outcome is dropped
                self._stats["items_abandoned"] += 1
            else:
                self._cond.notify_all()  # the oldest call, whose deadline the worker waits for, may be gone

    def close(self, timeout_s: float | None = CLOSE_TIMEOUT_S) -> None:
        """Refuse new calls, release the queued ones with ``BatcherClosedError``, let a running group
        finish, and join the worker for at most ``timeout_s`` seconds (``None``: without limit).
        Idempotent; safe to call from inside ``run_group``."""
        with self._cond:
            released = list(self._queue) if not self._closed else []
            self._closed = True
            self._queue.clear()
            self._stats["items_released_on_close"] += len(released)
            self._cond.notify_all()
            worker = self._worker
        for pending in released:
            pending._deliver(error=BatcherClosedError(_CLOSED_WHILE_QUEUED))
        if worker is None or worker is threading.current_thread():
            return  # never started, or close() came from run_group: the worker exits after this group
        worker.join(timeout_s)
        if worker.is_alive():
            _logger.warning(
                "%s: the group running when the batcher was closed has not finished after %s s; its "
                "callers keep waiting for it, and the worker thread exits once it is delivered",
                self._name,
                timeout_s,
            )

    @property
    def statistics(self) -> dict[str, int]:
        """Counters since creation (see ``__init__`` for each), plus ``queued``: calls waiting now."""
        with self._cond:
            return {**self._stats, "queued": len(self._queue)}

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def outstanding(self) -> int:
        """The most calls that were outstanding at once (queued or running) between the last two groups'
        forming: with callers that wait for their answers, how many callers there are."""
        with self._cond:
            return self._formed_peak

    # -- worker's side -----------------------------------------------------------------------------

    def _start_worker(self) -> None:
        # Called under the lock. The worker exits only once closed; is_alive() covers a worker that
        # died anyway (it cannot, short of the interpreter shutting down), so the queue is never stranded.
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._worker.start()

    def _serve(self) -> None:
        while True:
            group: list[Pending[T]] = []
            try:
                taken = self._next_group()
                if taken is None:
                    return
                group, forming_error = taken
                outcomes = self._run(group) if forming_error is None else self._fail_all(group, forming_error)
            except BaseException as bug:  # a bug of the batcher itself: fail the group, keep serving
                with self._cond:
                    self._stats["batcher_errors"] += 1
                if not group:
                    _logger.exception("%s: unexpected error outside any group", self._name)
                    continue
                outcomes = self._fail_all(group, bug)
            self._deliver(group, outcomes)
            del outcomes  # do not hold the last group's results while waiting for the next one

    def _next_group(self) -> tuple[list[Pending[T]], BaseException | None] | None:
        """Wait for the next group and take it off the queue; ``None`` once closed. A group whose
        forming raised (in ``is_full``) is returned with that error, to be failed as a whole."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            while True:
                if self._closed:
                    return None  # close() has released everything queued
                try:
                    size, full, skipped = self._group_size()
                except BaseException as error:
                    self._stats["batcher_errors"] += 1
                    if self._closed:
                        return None  # is_full closed the batcher, which released the queue, then raised
                    return self._take(self._scanned), error
                if self._closed:
                    return None  # is_full closed the batcher
                if not self._queue:
                    # every queued caller stopped waiting; wait for the next call (or close)
                    while not self._queue and not self._closed:
                        self._cond.wait()
                    continue
                since = max(self._queue[0].submitted_at, self._delivered_at)
                remaining = since + self._max_delay_s - time.monotonic()
                # a skipped call leaves room that a caller just answered may still fill; once as many
                # calls have come as the last group held, waiting longer would only delay this one
                if full or (skipped and self._arrived >= self._last_taken):
                    self._stats["groups_full"] += 1
                elif remaining > 0 and self._everyone_queued():
                    self._stats["groups_all_callers"] += 1
                elif remaining > 0:
                    self._cond.wait(remaining)
                    continue
                return self._take(size), None

    def _everyone_queued(self) -> bool:
        """Whether every caller known from the last windows has a call queued (called under the lock,
        while no group runs). Before the first group nothing is known, so the first call waits its delay."""
        known = max(self._window_peaks, default=0)
        return known > 0 and len(self._queue) >= max(known, self._peak)

    def _group_size(self) -> tuple[list[int], bool, bool]:
        """The queue positions the next group takes, whether ``is_full`` says that group is full, and
        whether ``choose`` left a queued item out. Recounted from the head on every wake, since a caller
        may have left the queue in between."""
        queue = [pending.item for pending in self._queue]  # a snapshot: is_full may close the batcher
        self._scanned = [0]  # if choose raises, the oldest call fails with it
        chosen = list(range(len(queue))) if self._choose is None else self._choose(list(queue))
        # the oldest always runs, so that a call left out waits for at most the items ahead of it
        positions = sorted({0, *chosen} & set(range(len(queue))))
        skipped = len(positions) < len(queue)
        items: list[T] = []
        self._scanned = []
        for index in positions:
            items.append(queue[index])
            self._scanned.append(index)
            if self._is_full(list(items)):
                return list(self._scanned), True, skipped
        return list(self._scanned), False, skipped

    def _take(self, positions: list[int]) -> list[Pending[T]]:
        # Called under the lock.
        queue = list(self._queue)
        taken = set(position for position in positions if position < len(queue))
        group = [queue[position] for position in sorted(taken)]
        self._queue = deque(pending for position, pending in enumerate(queue) if position not in taken)
        self._stats["groups_run"] += 1
        self._stats["items_run"] += len(group)
        self._stats["largest_group"] = max(self._stats["largest_group"], len(group))
        self._formed_peak = max(self._peak, len(queue))
        self._window_peaks.append(self._formed_peak)
        self._arrived, self._last_taken = 0, len(group)
        self._running = len(group)
        self._peak = len(self._queue) + self._running
        return group

    def _run(self, group: list[Pending[T]]) -> list[Any]:
        """Call ``run_group`` outside the lock (submits keep queuing meanwhile) and check its answer."""
        try:
            outcomes = self._run_group([pending.item for pending in group])
        except BaseException as error:
            return self._fail_all(group, error)
        try:
            count = len(outcomes)
        except TypeError:
            count = None
        if count != len(group):
            got = f"{count} entries" if count is not None else f"a {type(outcomes).__name__}"
            return self._fail_all(
                group,
                RuntimeError(
                    f"{self._name}: run_group returned {got} for a group of {len(group)} calls; results "
                    "are assigned to callers by position, so none was (a bug of run_group)"
                ),
                copies=False,
            )
        return list(outcomes)

    def _fail_all(self, group: list[Pending[T]], error: BaseException, copies: bool = True) -> list[Any]:
        with self._cond:
            self._stats["groups_failed"] += 1
        if copies:
            return list(_for_each_caller(error, len(group)))
        # a fresh exception per caller, so each traceback is that caller's own
        return [type(error)(*error.args) for _ in group]

    def _deliver(self, group: list[Pending[T]], outcomes: list[Any]) -> None:
        with self._cond:
            self._running = 0  # before its callers wake: one that calls again is counted once
            self._delivered_at = time.monotonic()
        failed = 0
        for pending, outcome in zip(group, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                failed += 1
                pending._deliver(error=outcome)
            else:
                pending._deliver(result=outcome)
        with self._cond:
            self._stats["items_failed"] += failed
