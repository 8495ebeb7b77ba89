"""The serving plan (provider option ``serving_plan="cost"``): few executables, chosen from the traffic by the
cost model (``runtime.cost_model``), compiled in the background and kept resident.

Per group of calls that can share executables (one micro-batch, the same exact sizes and branches), the
planner keeps the histogram of the sizes calls need (the smallest bucket that holds each padded
dimension) and the plan: the few bucket sizes that serve that traffic at the least modeled cost, at most
as many executables as the session's IPU groups keep resident (``ipu_groups``). A call is served

1. by its planned executable when that one is compiled (or listed by the plan kept in the cache: it is
   then loaded, never compiled);
2. otherwise at once by a compiled executable that holds it (padded further: the padding proof's verdict
   is a property of the dimension, proven at fixed sizes, so any larger bucket is as exact), while its
   planned executable compiles in the background, on up to ``compile_workers`` host threads; the next
   calls use it once it is ready;
3. and only when nothing compiled holds it, by a compile it waits for: the group's largest shape, so
   that this first compile serves every later call of the group (logged with the reason).

A decoder whose key/value cache stays on the device (``runtime.carried_state``) serves its prompts from
the plan and its decoding steps from one decode executable, resident beside the planned ones. Where the
session's IPU groups cannot keep both resident, each generation would switch twice (to the decode
executable and back), so the planner prices the other arrangement too (``decode_arrangement``): the
decoding steps served by the plan's own executable of the graph with a past, a step's one new token padded
along the new tokens and a prompt's empty past along the past (each only where the padding proof pads that
dimension), and keeps the one the cost model finds cheaper per generation.

Packed rows (``runtime.packing``) are planned the same way: a few fixed layouts (row length, rows) chosen
from the groups the batcher gathered (``cost_model.plan_layouts``). The plan and its histograms are kept
in the cache root (``serving-plans/<graph digest>/<settings>.json``, a self-hashed JSON record), so the
next process starts from them and reaches the steady state without compiling.

Whether a call is served and what it returns never depend on the plan: it only chooses among sizes the
padding proof already allows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optimum_ipu_backend.runtime.cache_files import read_record, write_record
from optimum_ipu_backend.runtime.cost_model import (
    CostModel,
    group_positions,
    layout_step,
    plan_layouts,
    plan_sizes,
)
from optimum_ipu_backend.runtime.row_placement import first_fit_decreasing

_logger = logging.getLogger(__name__)

PLAN_FORMAT = 3  # 2: packed groups keep the callers the batcher counted; 3: decoding steps and arrangement
PLAN_MODES = ("buckets", "cost")
#: The planner plans again when a group has seen this many calls, then 8 times as many, ... (and when a
#: call falls outside the plan): early while the histogram says little, rarely once it is stable, since
#: each change may cost compiles and moves executables between IPU groups.
FIRST_REPLAN = 8
REPLAN_FACTOR = 8
#: Packed groups kept in the record, and the most recent of them a plan is made from (planning is
#: first-fit-decreasing over every candidate layout, on the batcher's thread).
PACKED_GROUPS_KEPT = 256
PLANNED_GROUPS = 32
#: The packed layouts are first planned once each caller the batcher counted has called this many times.
PACKED_PLAN_ROUNDS = 4

Sizes = tuple[int, ...]
#: The two ways a decoder's steps are served (``ServingPlanner.decode_arrangement``).
CARRIED = "carried"  # one decode executable with the cache on the device, beside the planned executables
SHARED = "shared"  # the planned executables of the graph with a past serve the steps too


@dataclass(frozen=True)
class GroupKey:
    """Calls that can share executables: one micro-batch, the same branches and exact sizes; ``padded``
    names the dimensions the plan sizes, in order."""

    micro: int | None
    branches: tuple[tuple[str, bool], ...]
    exact: tuple[tuple[str, int], ...]
    padded: tuple[str, ...]

    def values(self, sizes: Sizes) -> dict[str, int]:
        """Every dimension's size for an executable of this group at ``sizes``."""
        return {**dict(self.exact), **dict(zip(self.padded, sizes, strict=True))}

    def to_json(self) -> dict[str, Any]:
        return {
            "micro": self.micro,
            "branches": [list(item) for item in self.branches],
            "exact": [list(item) for item in self.exact],
            "padded": list(self.padded),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GroupKey:
        micro = data["micro"]
        if micro is not None and not isinstance(micro, int):
            raise ValueError("micro")
        return cls(
            micro,
            tuple((str(name), bool(flag)) for name, flag in data["branches"]),
            tuple((str(dim), int(size)) for dim, size in data["exact"]),
            tuple(str(dim) for dim in data["padded"]),
        )


@dataclass
class _Group:
    histogram: Counter = field(default_factory=Counter)  # needed sizes -> calls (decoding steps aside)
    steps: Counter = field(default_factory=Counter)  # needed sizes -> decoding steps, either arrangement
    plan: tuple[Sizes, ...] = ()
    replan_at: int = FIRST_REPLAN
    from_cache: frozenset[Sizes] = frozenset()  # planned by an earlier process: in the cache
    dirty: bool = False  # executables may have left the plan: release them at the next call
    planned: set[Sizes] = field(default_factory=set)  # every size this process planned, for release


class ServingPlanner:
    """The plan of one session: its groups, packed layouts, background compiles and the record it keeps.

    ``build(shapes, branches, background)`` compiles or loads one executable (``ExecutableTable.entry_for``);
    ``ready(shapes, branches)`` says whether it is in memory; ``shapes_at(values, branches)`` gives an
    executable's input shapes from its dimension sizes.

    Set by the runner: ``positions(key, sizes)``, the positions one run at ``sizes`` computes (default: the
    product of the sizes and the micro-batch); ``reserved``, executables outside the plan that stay
    resident (a decoder's decode executable); ``steps_refused()``, why the padding proof keeps decoding
    steps off the planned executables (None: it pads their new tokens and a prompt's past).
    """

    def __init__(
        self,
        *,
        model: CostModel,
        slots: int,
        candidates: Mapping[str, Sequence[int]],
        store: Path | None,
        compile_workers: int = 1,
        measure: Callable[[], Mapping[str, float | None]] | None = None,
    ) -> None:
        self._base_model = self.model = model
        self._measure = measure
        self.slots = max(1, slots)
        self.reserved = 0  # executables outside the plan that stay resident (a decode step's)
        self.positions: Callable[[GroupKey, Sizes], int] | None = None
        self.steps_refused: Callable[[], str | None] = lambda: "no decode executable"
        #: How decoding steps are served (CARRIED or SHARED) and the modeled figures it was chosen by.
        self.decode_arrangement = CARRIED
        self.decode_choice: dict[str, Any] | None = None
        self._candidates = {dim: tuple(sizes) for dim, sizes in candidates.items()}
        self._store = store
        self._groups: dict[GroupKey, _Group] = {}
        self._lock = threading.RLock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, compile_workers), thread_name_prefix="ipu-compile")
        self._pending: dict[tuple, Future] = {}
        self._failed: set[tuple] = set()
        self._warned_slots = False
        self.packed: PackedPlan | None = None
        self._closed = False
        self._stored_packed: Mapping[str, Any] | None = None
        self._load()

    # -- padded calls -----------------------------------------------------------------------------------

    def targets(
        self,
        key: GroupKey,
        needed: Sizes,
        *,
        ready: Callable[[Sizes], bool],
        build: Callable[[Sizes], None],
        release: Callable[[Sizes], object] = lambda sizes: None,
        load: Callable[[Sizes], object] = lambda sizes: None,
        step: bool = False,
    ) -> Sizes:
        """The sizes to serve a call that needs ``needed`` (per ``key.padded`` dimension) at. ``release``
        closes an executable the plan dropped, so that its IPUs go to the ones the plan keeps; ``load``
        loads one built in the background onto its IPUs, so that the first call it serves does not switch.
        ``step``: a decoding step served by the plan (``decode_arrangement`` is SHARED); counted apart from
        the prompts, it never brings a replan forward but one it does not fit."""
        largest = tuple(self._candidates[dim][-1] for dim in key.padded)
        with self._lock:
            group = self._groups.setdefault(key, _Group())
            (group.steps if step else group.histogram)[needed] += 1
            calls = sum(group.histogram.values())
            if calls >= group.replan_at or not _covering(group.plan, needed):
                while group.replan_at <= calls:
                    group.replan_at *= REPLAN_FACTOR
                self._replan()
                group.dirty = True
            ideal = _cheapest(_covering(group.plan, needed))
            from_cache = ideal in group.from_cache
            stale = []
            if group.dirty:  # the plan changed, or a background build ended: release what it dropped
                group.dirty = False
                stale = self._stale(key)
        for sizes in stale:
            if ready(sizes):
                release(sizes)
        if ideal is None:  # a shape no plan can hold (more dimensions than the planner sizes)
            return needed
        if from_cache or ready(ideal):
            return ideal
        compiled = _cheapest([sizes for sizes in self._known(key) if _holds(sizes, needed) and ready(sizes)])
        if compiled is not None:

            def build_planned() -> None:
                build(ideal)
                with self._lock:
                    group.dirty = True
                    stale = self._stale(key) if ideal in group.plan else []
                if ideal in group.plan:  # swapped in: what the plan dropped goes, the planned one loads
                    for sizes in stale:
                        if ready(sizes):
                            release(sizes)
                    load(ideal)

            self.compile_later(("padded", key, ideal), build_planned)
            return compiled
        if all(size > 0 for size in largest) and largest != ideal and not self._any_ready(key, ready):
            _logger.info(
                "no compiled executable can take a call needing %s; compiling the largest shape %s first, so "
                "that it serves every later call while %s compiles in the background",
                dict(zip(key.padded, needed, strict=True)),
                dict(zip(key.padded, largest, strict=True)),
                dict(zip(key.padded, ideal, strict=True)),
            )
            # the planned one starts once the largest is built (the next call finds it compiled): builds of
            # one export share its weights file and its lock, and this call must not wait behind it
            return largest
        _logger.info(
            "no compiled executable can take a call needing %s; it waits for the compile of %s",
            dict(zip(key.padded, needed, strict=True)),
            dict(zip(key.padded, ideal, strict=True)),
        )
        return ideal

    def count_step(self, key: GroupKey, needed: Sizes) -> None:
        """Count a decoding step the decode executable served (the CARRIED arrangement): the planner prices
        the arrangements from the steps per prompt."""
        with self._lock:
            self._groups.setdefault(key, _Group()).steps[needed] += 1

    def _stale(self, key: GroupKey) -> list[Sizes]:
        """The group's executables the plan dropped (the largest stays: it serves any call the plan does
        not hold yet)."""
        group = self._groups[key]
        largest = tuple(self._candidates[dim][-1] for dim in key.padded)
        return [sizes for sizes in self._known(key) if sizes not in group.plan and sizes != largest]

    def _known(self, key: GroupKey) -> list[Sizes]:
        """Every size of the group an executable may exist for: planned (now or before), observed, and the
        largest."""
        group = self._groups[key]
        largest = tuple(self._candidates[dim][-1] for dim in key.padded)
        return sorted({*group.plan, *group.planned, *group.histogram, *group.steps, largest})

    def _any_ready(self, key: GroupKey, ready: Callable[[Sizes], bool]) -> bool:
        return any(ready(sizes) for sizes in self._known(key))

    def _replan(self) -> None:
        """Plan every group again (called with the lock held) and keep the result in the cache."""
        if self._measure is not None:
            self.model = self._base_model.measured(**self._measure())
        packed = 0 if self.packed is None else len(self.packed.plan)
        busy = sorted(self._groups.items(), key=lambda item: -sum(item[1].histogram.values()))
        busy = [(key, group) for key, group in busy if group.histogram]
        shared, final = self._arrange(busy, packed)
        reserved = 0 if shared else self.reserved
        budget = self.slots - reserved - packed
        if busy and budget < len(busy) and final and not self._warned_slots:
            self._warned_slots = True
            _logger.warning(
                "the traffic needs at least %d resident executables and the session holds %d IPU group(s) "
                "(ipu_groups): steady calls will switch executables; raise ipu_groups",
                len(busy) + reserved,
                self.slots,
            )
        for (key, group), slots in zip(
            busy, _group_slots(self.slots, budget, len(busy), reserved), strict=True
        ):
            group.plan = self._plan_group(key, group, slots, shared)
            group.planned.update(group.plan)
        self._save()

    def _arrange(self, busy: list[tuple[GroupKey, _Group]], packed: int) -> tuple[bool, bool]:
        """Whether decoding steps are served by the planned executables (SHARED), chosen by the modeled
        device seconds per generation, and whether that choice is final (steps seen, or no choice)."""
        refused = self.steps_refused() if self.reserved else "no decode executable"
        steps = sum(sum(group.steps.values()) for _, group in busy)
        prompts = sum(sum(group.histogram.values()) for _, group in busy)
        if refused is not None or not steps or not prompts:
            if refused is not None and self.decode_arrangement == SHARED:
                self.decode_arrangement = CARRIED
            return self.decode_arrangement == SHARED, refused is not None or bool(steps)
        model = self.model
        seconds = {}
        for arrangement in (CARRIED, SHARED):
            shared = arrangement == SHARED
            reserved = 0 if shared else self.reserved
            budget = self.slots - reserved - packed
            computed = 0
            for (key, group), slots in zip(
                busy, _group_slots(self.slots, budget, len(busy), reserved), strict=True
            ):
                plan = self._plan_group(key, group, slots, shared)
                served = group.histogram + group.steps if shared else group.histogram
                computed += sum(
                    count * self._positions(key, _cheapest(_covering(plan, needed)) or needed)
                    for needed, count in served.items()
                )
                if not shared:  # the decode executable computes the step's own new tokens
                    computed += sum(
                        count * self._positions(key, needed) for needed, count in group.steps.items()
                    )
            # sharing one IPU group, the prompt's executable and the decode executable swap twice a generation
            switches = 0 if shared or budget >= len(busy) else 2
            seconds[arrangement] = model.price(switches=switches, computed_tokens=computed / prompts)
        chosen = SHARED if seconds[SHARED] < seconds[CARRIED] else CARRIED
        if chosen != self.decode_arrangement:
            _logger.info(
                "decoding steps: %s (modeled device time per generation: %.3f ms with the decode executable, "
                "%.3f ms served by the planned executables; %.1f steps per prompt, %d IPU group(s))",
                "served by the planned executables, one new token padded along the new tokens"
                if chosen == SHARED
                else "served by the decode executable",
                seconds[CARRIED] * 1e3,
                seconds[SHARED] * 1e3,
                steps / prompts,
                self.slots,
            )
        self.decode_arrangement = chosen
        self.decode_choice = {
            "arrangement": chosen,
            "per_generation_seconds": seconds,
            "steps_per_prompt": steps / prompts,
        }
        return chosen == SHARED, True

    def _positions(self, key: GroupKey, sizes: Sizes) -> int:
        if self.positions is not None:
            return self.positions(key, sizes)
        return math.prod(sizes) * math.prod(size for _, size in key.exact) * (key.micro or 1)

    def _plan_group(
        self, key: GroupKey, group: _Group, slots: int, shared: bool = False
    ) -> tuple[Sizes, ...]:
        """The group's plan: its prompts' (and with ``shared`` its decoding steps') sizes. The one padded
        dimension whose size varies among the calls is planned by ``plan_sizes``, the others at the one
        size they need; where several vary, one executable at the largest of each."""
        histogram = group.histogram + group.steps if shared else group.histogram
        if not histogram:
            return ()
        ranks = range(len(key.padded))
        top = tuple(max(needed[i] for needed in histogram) for i in ranks)
        varying = [i for i in ranks if len({needed[i] for needed in histogram}) > 1]
        if len(varying) > 1:
            return (top,)
        axis = varying[0] if varying else 0

        def at(size: int) -> Sizes:
            return (*top[:axis], size, *top[axis + 1 :])

        counts: Counter = Counter()
        for needed, count in histogram.items():
            counts[needed[axis]] += count
        sizes = plan_sizes(
            counts,
            self._candidates[key.padded[axis]],
            slots,
            self.model,
            tokens=lambda size: self._positions(key, at(size)),
            compiled={sizes[axis] for sizes in group.plan if at(sizes[axis]) == sizes},
        )
        return tuple(at(size) for size in sizes)

    # -- background compiles ---------------------------------------------------------------------------

    def compile_later(self, job: tuple, build: Callable[[], object]) -> None:
        """Run ``build`` on a compile thread unless it runs, ran or failed already."""
        with self._lock:
            if self._closed or job in self._pending or job in self._failed:
                return

            def run() -> None:
                try:
                    build()
                except Exception as exc:  # a call that needs it compiles it itself and gets the error
                    with self._lock:
                        self._failed.add(job)
                    _logger.warning("a background compile failed (%s); calls keep their executables", exc)

            self._pending[job] = self._pool.submit(run)

    def wait_for_compiles(self, timeout: float | None = None) -> bool:
        """Wait until every background compile started so far is done; False on timeout."""
        with self._lock:
            futures = list(self._pending.values())
        _, not_done = wait(futures, timeout=timeout)
        return not not_done

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the record in the cache -----------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """The plan, the histograms behind it and the cost model, for users and benchmarks."""
        with self._lock:
            return {
                "ipu_groups": self.slots,
                "cost_model": self.model.to_dict(),
                "decode": self.decode_choice,
                **self._body(),
            }

    def _body(self) -> dict[str, Any]:
        groups = [
            {
                **key.to_json(),
                "histogram": [[list(sizes), count] for sizes, count in sorted(group.histogram.items())],
                "steps": [[list(sizes), count] for sizes, count in sorted(group.steps.items())],
                "plan": [list(sizes) for sizes in group.plan],
            }
            for key, group in self._groups.items()
        ]
        packed = None if self.packed is None else self.packed.to_json()
        return {"groups": groups, "packed": packed, "decode_arrangement": self.decode_arrangement}

    def _save(self) -> None:
        if self._store is not None:
            write_record(self._store, PLAN_FORMAT, self._body(), "serving plan")

    def _load(self) -> None:
        body = None if self._store is None else read_record(self._store, PLAN_FORMAT, "serving plan")
        if body is None:
            return
        try:
            for data in body["groups"]:
                key = GroupKey.from_json(data)
                group = _Group(
                    Counter({tuple(int(s) for s in sizes): int(count) for sizes, count in data["histogram"]}),
                    Counter({tuple(int(s) for s in sizes): int(count) for sizes, count in data["steps"]}),
                    tuple(tuple(int(s) for s in sizes) for sizes in data["plan"]),
                )
                calls = sum(group.histogram.values())
                while group.replan_at <= calls:
                    group.replan_at *= REPLAN_FACTOR
                group.from_cache = frozenset(group.plan)
                self._groups[key] = group
            self._stored_packed = body.get("packed")
            if body["decode_arrangement"] not in (CARRIED, SHARED):
                raise ValueError("decode_arrangement")
            self.decode_arrangement = body["decode_arrangement"]
        except (KeyError, TypeError, ValueError) as exc:
            _logger.warning("ignoring the serving plan %s (%s); planning again", self._store, exc)
            self._groups = {}
            self._stored_packed = None
            self.decode_arrangement = CARRIED

    def packed_plan(self, row_lengths: Sequence[int], row_counts: Sequence[int], steps_of) -> PackedPlan:
        """The packed rows' part of the plan (``runtime.packing.PackedRunner`` asks for it once)."""
        self.packed = PackedPlan(self, row_lengths, row_counts, steps_of, self._stored_packed)
        return self.packed


class PackedPlan:
    """The few packed layouts (row length, rows per micro-batch) a session keeps, from the groups seen, and
    the fill layout whose steps the batcher fills (``choose``)."""

    def __init__(
        self,
        owner: ServingPlanner,
        row_lengths: Sequence[int],
        row_counts: Sequence[int],
        steps_of: Callable[[int, int], int],
        stored: Mapping[str, Any] | None,
    ) -> None:
        self._owner = owner
        self.row_lengths = tuple(row_lengths)
        self.row_counts = tuple(row_counts)
        self._steps_of = steps_of
        self._groups: list[list[tuple[int, ...]]] = []  # calls of each gathered group, their lengths
        self._clients: list[int | None] = []  # per group, the callers the batcher counted (None: unknown)
        self.calls = 0
        self.plan: tuple[tuple[int, int], ...] = ()
        self.fill: tuple[int, int] | None = None
        self.from_cache: frozenset[tuple[int, int]] = frozenset()
        self._replan_at = FIRST_REPLAN
        self._planned_longest = 0  # the longest sequence of the groups the plan was made from
        self.dirty = False
        if stored:
            try:
                self._groups = [[tuple(int(n) for n in call) for call in group] for group in stored["groups"]]
                self._clients = [None if n is None else int(n) for n in stored["clients"]]
                if len(self._clients) != len(self._groups):
                    raise ValueError("one client count per group")
                self.calls = int(stored["calls"])
                self.plan = tuple((int(t), int(m)) for t, m in stored["plan"])
                self.fill = (
                    None if stored["fill"] is None else (int(stored["fill"][0]), int(stored["fill"][1]))
                )
                self.from_cache = frozenset(self.plan)
                self._planned_longest = _longest(self._groups[-PLANNED_GROUPS:])
                while self._replan_at <= self.calls:
                    self._replan_at *= REPLAN_FACTOR
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                _logger.warning("ignoring the stored packed plan (%s); planning again", exc)
                self._groups, self._clients, self.calls, self.plan, self.fill = [], [], 0, (), None

    @property
    def first_layout(self) -> tuple[int, int]:
        """What the first packed compile builds: the longest rows, one row per micro-batch. It serves every
        group, its rows as consecutive steps, and computes no more rows than a group fills: it serves the
        groups before the plan exists, and the calls the fill layout leaves to it alone."""
        return self.row_lengths[-1], self.row_counts[0]

    def choose(self, calls: Sequence[Sequence[int]]) -> list[int]:
        """The positions of the queued calls (each its sequences' lengths) the batcher's next group takes:
        ``cost_model.group_positions`` at the fill layout's step (a call it cannot hold filling the first
        layout's, where that one has an IPU group of its own), every call without a fill layout."""
        with self._owner._lock:  # a replan may change the fill layout, other threads the padded groups
            fill, own_group = self.fill, self._first_has_own_group()
        if fill is None:
            return list(range(len(calls)))
        per_step = self._steps_of(1, 1)
        fits, capacity = layout_step(fill, per_step, _rows_of)
        wider = layout_step(self.first_layout, per_step, _rows_of) if own_group else None
        return group_positions([tuple(call) for call in calls], fits, capacity, wider)

    def _first_has_own_group(self) -> bool:
        """Whether the IPU groups the unpacked plan and reserved executables leave hold more than one
        layout: the first layout then keeps one of its own (and serves the calls the fill layout leaves)."""
        owner = self._owner
        unpacked = sum(len(group.plan) for group in owner._groups.values())
        return owner.slots - owner.reserved - unpacked > 1

    def record(self, calls: Sequence[tuple[int, ...]], clients: int | None = None) -> set[tuple[int, int]]:
        """Count a gathered group (its calls' sequence lengths, and how many callers were outstanding
        while it formed), plan again when due, and return, after a change, the layouts outside the plan (but
        the first, which serves any group) to release."""
        owner = self._owner
        with owner._lock:
            self._groups.append(list(calls))
            self._clients.append(clients if clients and clients > 0 else None)
            del self._groups[:-PACKED_GROUPS_KEPT]
            del self._clients[:-PACKED_GROUPS_KEPT]
            self.calls += len(calls)
            # a call longer than any the plan was made from, and than its layouts, is news: plan again (the
            # plan may leave the rare longest calls it saw to the first layout on purpose)
            longest = _longest([calls])
            outside = (
                bool(self.plan)
                and longest > self._planned_longest
                and not any(tokens >= longest for tokens, _ in self.plan)
            )
            # the first plan waits for a few rounds of every caller: what the batcher gathers while the
            # first layout serves says little more than the lengths seen (the first layout serves meanwhile)
            callers = max((n for n in self._clients if n is not None), default=1)
            due = self.calls >= self._replan_at and self.calls >= PACKED_PLAN_ROUNDS * callers
            if due or outside:
                while self._replan_at <= self.calls:
                    self._replan_at *= REPLAN_FACTOR
                self._replan()
                self.dirty = True
            stale: set[tuple[int, int]] = set()
            if self.dirty:
                self.dirty = False
                every = {(tokens, micro) for tokens in self.row_lengths for micro in self.row_counts}
                stale = every - set(self.plan) - {self.first_layout}
            return stale

    def _replan(self) -> None:
        owner = self._owner
        unpacked = sum(len(group.plan) for group in owner._groups.values())
        slots = owner.slots - owner.reserved - unpacked
        own_group = self._first_has_own_group()
        if own_group:
            slots -= 1  # the first layout keeps an IPU group of its own (as a group's largest shape)
        counted = [n for n in self._clients[-PLANNED_GROUPS:] if n is not None]
        planned = self._groups[-PLANNED_GROUPS:]
        self._planned_longest = _longest(planned)
        self.plan, self.fill = plan_layouts(
            planned,
            self.row_lengths,
            self.row_counts,
            max(1, slots),
            owner.model,
            self._steps_of,
            _rows_of,
            compiled=self.plan,
            clients=max(counted, default=None),
            # resident on its own IPU group, the first layout serves the rare calls the fill layout leaves
            first=self.first_layout if own_group else None,
        )
        owner._save()

    def compile_later(self, job: tuple, build: Callable[[], object]) -> None:
        def build_planned() -> None:
            build()
            with self._owner._lock:
                self.dirty = True

        self._owner.compile_later(job, build_planned)

    def to_json(self) -> dict[str, Any]:
        return {
            "groups": [[list(call) for call in group] for group in self._groups],
            "clients": list(self._clients),
            "calls": self.calls,
            "plan": [list(layout) for layout in self.plan],
            "fill": None if self.fill is None else list(self.fill),
        }


def measured_times(statistics: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """The mean compile and load seconds of a table's executables (``ExecutableTable.statistics``): built
    by a compile, or loaded from the cache."""

    def mean(source: str) -> float | None:
        seconds = [float(entry["compile_seconds"]) for entry in statistics if entry["source"] == source]
        return sum(seconds) / len(seconds) if seconds else None

    return {"compile_seconds": mean("compiled"), "load_seconds": mean("cache")}


def settings_digest(settings: Mapping[str, Any]) -> str:
    """The file name of a plan: what the plan depends on besides the graph (sizes, IPU groups, steps)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _rows_of(lengths: Sequence[int], tokens: int) -> int | None:
    """Rows first-fit-decreasing fills with sequences of these lengths (None: one is longer than a row)."""
    placements = first_fit_decreasing(lengths, tokens, None)
    return None if placements is None else 1 + max(p.row for p in placements)


def _longest(groups: Sequence[Sequence[tuple[int, ...]]]) -> int:
    return max((n for group in groups for call in group for n in call), default=0)


def _group_slots(slots: int, budget: int, groups: int, reserved: int) -> list[int]:
    """The executables each busy group may plan (busiest first) out of ``budget`` IPU groups: one each,
    the rest to the busiest; each group's largest shape, compiled first, keeps an IPU group of its own
    where the session holds more than the groups and ``reserved`` executables need, so that a call the plan
    does not hold yet runs there without a switch."""
    if slots > groups + reserved:
        budget -= groups
    extra = max(0, budget - groups)
    return [1 + (extra if index == 0 else 0) for index in range(groups)]


def _holds(sizes: Sizes, needed: Sizes) -> bool:
    return all(size >= need for size, need in zip(sizes, needed, strict=True))


def _covering(plan: Sequence[Sizes], needed: Sizes) -> list[Sizes]:
    return [sizes for sizes in plan if _holds(sizes, needed)]


def _cheapest(options: Sequence[Sizes]) -> Sizes | None:
    return min(options, key=math.prod) if options else None
