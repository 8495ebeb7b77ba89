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
from optimum_ipu_backend.runtime.cost_model import CostModel, plan_layouts, plan_sizes
from optimum_ipu_backend.runtime.row_placement import first_fit_decreasing

_logger = logging.getLogger(__name__)

PLAN_FORMAT = 2  # 2: packed groups keep the callers the batcher counted
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
    histogram: Counter = field(default_factory=Counter)  # needed sizes -> calls
    plan: tuple[Sizes, ...] = ()
    replan_at: int = FIRST_REPLAN
    from_cache: frozenset[Sizes] = frozenset()  # planned by an earlier process: in the cache
    dirty: bool = False  # executables may have left the plan: release them at the next call


class ServingPlanner:
    """The plan of one session: its groups, packed layouts, background compiles and the record it keeps.

    ``build(shapes, branches, background)`` compiles or loads one executable (``ExecutableTable.entry_for``);
    ``ready(shapes, branches)`` says whether it is in memory; ``shapes_at(values, branches)`` gives an
    executable's input shapes from its dimension sizes; ``tokens(values)`` the positions one run computes.
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
    ) -> Sizes:
        """The sizes to serve a call that needs ``needed`` (per ``key.padded`` dimension) at. ``release``
        closes an executable the plan dropped, so that its IPUs go to the ones the plan keeps."""
        largest = tuple(self._candidates[dim][-1] for dim in key.padded)
        with self._lock:
            group = self._groups.setdefault(key, _Group())
            group.histogram[needed] += 1
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
                stale = [sizes for sizes in self._known(key) if sizes not in group.plan and sizes != largest]
        for sizes in stale:  # the largest stays: it serves any call the plan does not hold yet
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

    def _known(self, key: GroupKey) -> list[Sizes]:
        """Every size of the group an executable may exist for: planned, observed, and the largest."""
        group = self._groups[key]
        largest = tuple(self._candidates[dim][-1] for dim in key.padded)
        return sorted({*group.plan, *group.histogram, largest})

    def _any_ready(self, key: GroupKey, ready: Callable[[Sizes], bool]) -> bool:
        return any(ready(sizes) for sizes in self._known(key))

    def _replan(self) -> None:
        """Plan every group again (called with the lock held) and keep the result in the cache."""
        if self._measure is not None:
            self.model = self._base_model.measured(**self._measure())
        budget = self.slots - self.reserved - (0 if self.packed is None else len(self.packed.plan))
        busy = sorted(self._groups.items(), key=lambda item: -sum(item[1].histogram.values()))
        busy = [(key, group) for key, group in busy if group.histogram]
        if busy and budget < len(busy) and not self._warned_slots:
            self._warned_slots = True
            _logger.warning(
                "the traffic needs at least %d resident executables and the session holds %d IPU group(s) "
                "(ipu_groups): steady calls will switch executables; raise ipu_groups",
                len(busy) + self.reserved,
                self.slots,
            )
        if self.slots > len(busy) + self.reserved:
            # each group's largest shape, compiled first, keeps an IPU group of its own: a call the plan
            # does not hold yet runs there without a switch
            budget -= len(busy)
        extra = max(0, budget - len(busy))
        for index, (key, group) in enumerate(busy):
            slots = 1 + (extra if index == 0 else 0)
            group.plan = self._plan_group(key, group, slots)
        self._save()

    def _plan_group(self, key: GroupKey, group: _Group, slots: int) -> tuple[Sizes, ...]:
        if len(key.padded) != 1:  # several padded dimensions: one executable at the largest of each
            return (tuple(max(needed[i] for needed in group.histogram) for i in range(len(key.padded))),)
        dim = key.padded[0]
        others = math.prod(size for _, size in key.exact) * (key.micro or 1)
        histogram = {needed[0]: count for needed, count in group.histogram.items()}
        sizes = plan_sizes(
            histogram,
            self._candidates[dim],
            slots,
            self.model,
            tokens=lambda size: size * others,
            compiled={sizes[0] for sizes in group.plan},
        )
        return tuple((size,) for size in sizes)

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
                **self._body(),
            }

    def _body(self) -> dict[str, Any]:
        groups = [
            {
                **key.to_json(),
                "histogram": [[list(sizes), count] for sizes, count in sorted(group.histogram.items())],
                "plan": [list(sizes) for sizes in group.plan],
            }
            for key, group in self._groups.items()
        ]
        packed = None if self.packed is None else self.packed.to_json()
        return {"groups": groups, "packed": packed}

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
                    tuple(tuple(int(s) for s in sizes) for sizes in data["plan"]),
                )
                calls = sum(group.histogram.values())
                while group.replan_at <= calls:
                    group.replan_at *= REPLAN_FACTOR
                group.from_cache = frozenset(group.plan)
                self._groups[key] = group
            self._stored_packed = body.get("packed")
        except (KeyError, TypeError, ValueError) as exc:
            _logger.warning("ignoring the serving plan %s (%s); planning again", self._store, exc)
            self._groups = {}
            self._stored_packed = None

    def packed_plan(self, row_lengths: Sequence[int], row_counts: Sequence[int], steps_of) -> PackedPlan:
        """The packed rows' part of the plan (``runtime.packing.PackedRunner`` asks for it once)."""
        self.packed = PackedPlan(self, row_lengths, row_counts, steps_of, self._stored_packed)
        return self.packed


class PackedPlan:
    """The few packed layouts (row length, rows per micro-batch) a session keeps, from the groups seen, and
    the fill layout whose steps the batcher fills (``fits``)."""

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
        """What the first packed compile builds: the longest rows at the most rows per micro-batch, which
        serve every group (more rows run as further steps)."""
        return self.row_lengths[-1], self.row_counts[-1]

    def fits(self, lengths: Sequence[int]) -> bool:
        """Whether sequences of these lengths fill at most one step of the fill layout (True without one)."""
        if self.fill is None:
            return True
        tokens, micro = self.fill
        placements = first_fit_decreasing(lengths, tokens, None)
        return placements is not None and 1 + max(p.row for p in placements) <= micro * self._steps_of(1, 1)

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
        def rows_of(lengths: Sequence[int], tokens: int) -> int | None:
            placements = first_fit_decreasing(lengths, tokens, None)
            return None if placements is None else 1 + max(p.row for p in placements)

        owner = self._owner
        unpacked = sum(len(group.plan) for group in owner._groups.values())
        slots = owner.slots - owner.reserved - unpacked
        own_group = slots > 1
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
            rows_of,
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


def _longest(groups: Sequence[Sequence[tuple[int, ...]]]) -> int:
    return max((n for group in groups for call in group for n in call), default=0)


def _holds(sizes: Sizes, needed: Sizes) -> bool:
    return all(size >= need for size, need in zip(sizes, needed, strict=True))


def _covering(plan: Sequence[Sizes], needed: Sizes) -> list[Sizes]:
    return [sizes for sizes in plan if _holds(sizes, needed)]


def _cheapest(options: Sequence[Sizes]) -> Sizes | None:
    return min(options, key=math.prod) if options else None
