"""What compiles, loads and device time cost on an IPU: the one model the serving plan minimises.

On the host emulator a compile is a legalization of a few seconds and running another executable is free;
on an IPU neither holds. A compile takes minutes, an IPU holds one loaded executable at a time, and running
another one on the same IPUs reloads it (a *switch*, ``engines.worker_server``). So the runtime plans with
three named estimates (docs/performance.md, "IPU cost model", gives their sources):

* ``compile_seconds`` (120 s): one compile of one shape. Graphcore's own notebooks: BERT-Large "takes ~10
  minutes to build the graph", and a cached executable brings it "to seconds instead of minutes";
* ``load_seconds`` (2 s): one load of a compiled executable onto its IPUs, and each switch (a reload);
  optimum-graphcore split its cache directories because loading many executables was slow;
* ``token_seconds`` (0.5 us): device time per computed position (a padded position costs what a real one
  does).

and one assumption about the traffic: ``horizon_calls``, how many calls an executable serves over the life
of its cache entry (10 million: a day at about a hundred calls a second). An executable beyond the first
is worth adding only where the device time it saves over that horizon exceeds its compile and its load.
Every figure is overridable with a provider option of the same name (``cost_compile_seconds``, ...), and
the engines that report a compile or load time of their own replace the estimate by the measurement.

The planners are pure functions of a length histogram (``plan_sizes`` for padded calls, ``plan_layouts``
for packed rows): tested without models, used by ``runtime.serving_plan``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from optimum_ipu_backend.config import positive_float_or_none
from optimum_ipu_backend.errors import ConfigurationError


@dataclass(frozen=True)
class Estimate:
    """A named figure of the model and where it comes from (shown in docs and reports)."""

    value: float
    source: str


COMPILE_SECONDS = Estimate(
    120.0,
    "Graphcore's BERT-Large notebook: building the graph 'takes ~10 minutes', cached executables bring it "
    "'to seconds instead of minutes' (gradient-ai/Graphcore-HuggingFace#2, #12); 2 minutes for a small "
    "encoder",
)
LOAD_SECONDS = Estimate(
    2.0,
    "an executable's code and weights moved onto its IPUs (docs/hardware.md); optimum-graphcore split its "
    "cache directories because loading many executables was slow (optimum-graphcore#214)",
)
TOKEN_SECONDS = Estimate(
    0.5e-6,
    "assumed: device time per computed position of a small encoder (all-MiniLM-L6-v2); only ratios "
    "between plans depend on it",
)
HORIZON_CALLS = Estimate(
    1e7, "assumed: calls one cached executable serves (a day at about a hundred calls per second)"
)

#: Orders of the sampled calls a closed-loop replay of packed traffic is priced over (``plan_layouts``):
#: which fill layout serves best depends on how the calls happened to group, and a sample is one order.
REPLAY_ORDERS = 4

#: Provider option -> the model's field it sets.
OPTION_FIELDS = {
    "cost_compile_seconds": "compile_seconds",
    "cost_load_seconds": "load_seconds",
    "cost_token_seconds": "token_seconds",
    "cost_horizon_calls": "horizon_calls",
}


class CostOptionError(ConfigurationError):
    """A cost model option is not a positive number."""


@dataclass(frozen=True)
class CostModel:
    compile_seconds: float = COMPILE_SECONDS.value
    load_seconds: float = LOAD_SECONDS.value
    token_seconds: float = TOKEN_SECONDS.value
    horizon_calls: float = HORIZON_CALLS.value
    #: Per field, where its value came from: the estimate's source, an option, or a measurement.
    sources: dict[str, str] = field(
        default_factory=lambda: {
            "compile_seconds": COMPILE_SECONDS.source,
            "load_seconds": LOAD_SECONDS.source,
            "token_seconds": TOKEN_SECONDS.source,
            "horizon_calls": HORIZON_CALLS.source,
        },
        compare=False,
    )

    @classmethod
    def from_options(cls, raw: Mapping[str, object]) -> CostModel:
        """The defaults, with every ``cost_*`` provider option in ``raw`` applied."""
        model = cls()
        for option, name in OPTION_FIELDS.items():
            if raw.get(option) is None:
                continue
            value = positive_float_or_none(raw[option])
            if value is None:
                raise CostOptionError(f"option {option!r}={raw[option]!r}: expected a positive number")
            model = replace(model, **{name: value}, sources={**model.sources, name: f"option {option!r}"})
        return model

    def measured(
        self, *, compile_seconds: float | None = None, load_seconds: float | None = None
    ) -> CostModel:
        """This model with the times an engine measured on its device in place of the estimates."""
        model = self
        for name, value in (("compile_seconds", compile_seconds), ("load_seconds", load_seconds)):
            if value is not None and value > 0:
                model = replace(model, **{name: value}, sources={**model.sources, name: "measured"})
        return model

    def executable_seconds(self, compiled: bool = False) -> float:
        """What adding one executable costs: its compile (unless compiled already) and its load."""
        return self.load_seconds + (0.0 if compiled else self.compile_seconds)

    def price(
        self, *, waited_compiles: int = 0, loads: int = 0, switches: int = 0, computed_tokens: int = 0
    ) -> float:
        """Modeled seconds calls spend: compiles they waited for, loads and switches, device compute.
        Compiles in the background run on host cores beside serving and delay no call."""
        return (
            waited_compiles * self.compile_seconds
            + (loads + switches) * self.load_seconds
            + computed_tokens * self.token_seconds
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "compile_seconds": self.compile_seconds,
            "load_seconds": self.load_seconds,
            "token_seconds": self.token_seconds,
            "horizon_calls": self.horizon_calls,
            "sources": dict(self.sources),
        }


# -- planning padded calls --------------------------------------------------------------------------------


def plan_sizes(
    histogram: Mapping[int, int],
    candidates: Sequence[int],
    slots: int,
    model: CostModel,
    tokens: Callable[[int], int],
    compiled: Iterable[int] = (),
) -> tuple[int, ...]:
    """The compiled sizes of one padded dimension that minimise the modeled cost of the traffic
    ``histogram`` (needed size -> calls): ``horizon_calls`` times the expected device time per call, plus
    compile and load of each size (only the load for sizes in ``compiled``). At most ``slots`` sizes (the
    executables that stay resident), always the smallest candidate that holds the longest call, so that
    every observed call is served without a compile. ``tokens(size)``: positions one call at that size
    computes. Exact dynamic programming over the candidates (a few dozen at most)."""
    if not histogram:
        return ()
    sizes = sorted(candidates)
    longest = max(histogram)
    top = next((index for index, size in enumerate(sizes) if size >= longest), None)
    if top is None:
        raise ValueError(f"no candidate size holds {longest}")
    sizes = sizes[: top + 1]
    calls = sum(histogram.values())
    done = set(compiled)
    scale = model.horizon_calls / calls * model.token_seconds
    # needed[j]: calls that need at most sizes[j]
    needed = [sum(count for size, count in histogram.items() if size <= bound) for bound in sizes]

    def served(low: int, high: int) -> float:
        """Modeled seconds of the calls needing (sizes[low-1], sizes[high]], served at sizes[high]."""
        count = needed[high] - (needed[low - 1] if low > 0 else 0)
        return count * tokens(sizes[high]) * scale + model.executable_seconds(sizes[high] in done)

    slots = max(1, min(slots, len(sizes)))
    # best[k][j]: cheapest cost of serving every call up to sizes[j] with k sizes, the last one sizes[j]
    best = [[math.inf] * len(sizes) for _ in range(slots + 1)]
    choice: list[list[int]] = [[-1] * len(sizes) for _ in range(slots + 1)]
    for j in range(len(sizes)):
        best[1][j] = served(0, j)
    for k in range(2, slots + 1):
        for j in range(len(sizes)):
            for i in range(j):
                cost = best[k - 1][i] + served(i + 1, j)
                if cost < best[k][j]:
                    best[k][j], choice[k][j] = cost, i
    k = min(range(1, slots + 1), key=lambda count: best[count][top])
    plan, j = [], top
    while j >= 0 and k >= 1:
        plan.append(sizes[j])
        j, k = choice[k][j], k - 1
    return tuple(sorted(plan))


# -- planning packed rows ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedGroup:
    """One gathered group of packed sequences, as the planner needs it: per row length, the rows its
    sequences fill (first-fit-decreasing; None where one is longer than the row)."""

    real_tokens: int
    rows: dict[int, int | None]
    calls: int = 1


def layout_cost(
    group: PackedGroup,
    layout: tuple[int, int],
    row_counts: Sequence[int],
    steps_of: Callable[[int, int], int],
    any_rows: bool = False,
) -> int | None:
    """Positions ``layout`` (row length, rows per micro-batch) computes for ``group``, or None when the
    runtime's own rule (``runtime.packing.choose_layout``) would not use it: a sequence longer than the row,
    or fewer rows per micro-batch than the group needs from one step (``any_rows``: the first layout, which
    serves any group, its rows beyond one step as further steps). ``steps_of(rows, micro)``: computed
    rows (``device_steps.plan_steps(...).padded_samples``)."""
    tokens, micro = layout
    rows = group.rows.get(tokens)
    if rows is None:
        return None
    per_step_rows = steps_of(1, 1)  # rows one step of micro-batch 1 holds: device iterations x replicas
    wanted = min(-(-rows // per_step_rows), max(row_counts))
    if micro < wanted and not any_rows:
        return None
    return steps_of(rows, micro) * tokens


#: A step the batcher fills: whether sequences of these lengths fit it, and the positions it holds.
Step = tuple[Callable[[Sequence[int]], bool], int]


def group_positions(
    queue: Sequence[tuple[int, ...]],
    fits: Callable[[Sequence[int]], bool],
    capacity: int | None = None,
    wider: Step | None = None,
) -> list[int]:
    """The batcher's rule for a packed step (``serving_plan.PackedPlan.choose``, and the replays below):
    the positions in ``queue`` (calls, each its sequences' lengths) the next group takes, the oldest
    always. In arrival order, the calls it still ``fits`` one step with. With ``capacity`` (the positions
    one step holds), the oldest and the others whose lengths fill the most of the step, by exact subset
    sum (ties go to the earliest calls): taking calls in arrival order leaves the room behind a call that
    does not fit, which a later shorter one could fill. That subset is kept only where it ``fits`` (a step
    of several rows may not place it) and holds more than arrival order does. ``wider``: the step of the
    layout that serves a call the fill layout cannot hold (the first layout, on an IPU group of its own):
    a group whose oldest call does not fit is filled to that step instead of running alone."""
    if wider is not None and queue and not fits(list(queue[0])):
        fits, capacity = wider
    in_order, members = [0], list(queue[0]) if queue else []
    for index in range(1, len(queue)):
        candidate = [*members, *queue[index]]
        if fits(candidate):
            in_order.append(index)
            members = candidate
    if capacity is None or len(in_order) == len(queue):
        return in_order if queue else []
    weights = [sum(call) for call in queue]
    room = capacity - weights[0]
    if room <= 0:
        return in_order
    chosen = [0, *(index + 1 for index in _fullest_subset(weights[1:], room))]
    if sum(weights[i] for i in chosen) > sum(weights[i] for i in in_order) and fits(
        [n for i in chosen for n in queue[i]]
    ):
        return chosen
    return in_order


def _fullest_subset(weights: Sequence[int], room: int) -> list[int]:
    """The indices of ``weights`` whose sum is the largest at most ``room``, preferring earlier ones: the
    reachable sums as bits of one integer per prefix, then walked back from the largest."""
    mask = (1 << (room + 1)) - 1
    reach = [1]
    for weight in weights:
        reach.append((reach[-1] | (reach[-1] << weight)) & mask)
    total = reach[-1].bit_length() - 1
    chosen = []
    for index in range(len(weights) - 1, -1, -1):
        if not (reach[index] >> total) & 1:  # not reachable without it: it is in
            chosen.append(index)
            total -= weights[index]
    return chosen[::-1]


def _next_group(
    queue: Sequence[tuple[int, ...]],
    fits: Callable[[Sequence[int]], bool],
    capacity: int | None = None,
    wider: Step | None = None,
) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The group ``group_positions`` takes from ``queue``, and the calls left queued, in order."""
    taken = set(group_positions(queue, fits, capacity, wider))
    return (
        [call for index, call in enumerate(queue) if index in taken],
        [call for index, call in enumerate(queue) if index not in taken],
    )


def refill(
    groups: Sequence[Sequence[tuple[int, ...]]],
    fits: Callable[[Sequence[int]], bool],
    capacity: int | None = None,
    wider: Step | None = None,
) -> list[list[tuple[int, ...]]]:
    """The groups the dynamic batcher forms from traffic that arrived as ``groups`` (each a list of calls,
    each call its sequences' lengths) when a group takes the calls ``group_positions`` chooses: the
    others stay queued, ahead of the calls that arrive next."""
    formed: list[list[tuple[int, ...]]] = []
    queue: list[tuple[int, ...]] = []
    for index, arrived in enumerate(groups):
        queue.extend(arrived)
        last = index == len(groups) - 1
        while queue:
            group, left = _next_group(queue, fits, capacity, wider)
            formed.append(group)
            queue = left
            if not last and (not queue or fits([n for call in queue for n in call])):
                break  # what is left waits for the calls that arrive next
    return formed


def closed_loop(
    calls: Sequence[tuple[int, ...]],
    clients: int,
    fits: Callable[[Sequence[int]], bool],
    capacity: int | None = None,
    wider: Step | None = None,
) -> list[list[tuple[int, ...]]]:
    """The groups the dynamic batcher forms when ``clients`` callers each wait for their answer before they
    call again (threads or connections of a server), the calls taken in the order of ``calls``.

    The batcher runs one group at a time; the next takes the calls ``group_positions`` chooses: of those
    the last group left queued, then the calls of the callers it answered, who call again within the
    batcher's delay (``batcher.DynamicBatcher``). So a step holds at most the calls of ``clients``
    callers: a fill layout larger than that runs part empty. Simulated over every call once.
    """
    return [group for group, _ in _closed_loop(calls, clients, fits, capacity, wider)]


def _closed_loop(
    calls: Sequence[tuple[int, ...]],
    clients: int,
    fits: Callable[[Sequence[int]], bool],
    capacity: int | None,
    wider: Step | None = None,
) -> list[tuple[list[tuple[int, ...]], bool]]:
    """``closed_loop``'s groups, each with whether it formed once the calls ran out (fewer queued than
    callers: the replay's end, which steady traffic does not have)."""
    if not calls:
        return []
    clients = max(1, min(clients, len(calls)))
    stream = iter(calls[clients:])
    queue = list(calls[:clients])
    formed: list[tuple[list[tuple[int, ...]], bool]] = []
    while queue:
        draining = len(queue) < clients
        group, left = _next_group(queue, fits, capacity, wider)
        formed.append((group, draining))
        queue = left + [call for call in (next(stream, None) for _ in group) if call is not None]
    return formed


def layout_step(
    layout: tuple[int, int], per_step: int, rows_of: Callable[[Sequence[int], int], int | None]
) -> Step:
    """The step of ``layout`` (row length, rows per micro-batch) the batcher fills: sequences fit where
    first-fit-decreasing places them in its rows (``per_step`` rows of micro-batch 1 per step)."""
    tokens, micro = layout

    def fits(lengths: Sequence[int]) -> bool:
        rows = rows_of(lengths, tokens)
        return rows is not None and rows <= micro * per_step

    return fits, tokens * micro * per_step


def plan_layouts(
    groups: Sequence[Sequence[tuple[int, ...]]],
    row_lengths: Sequence[int],
    row_counts: Sequence[int],
    slots: int,
    model: CostModel,
    steps_of: Callable[[int, int], int],
    rows_of: Callable[[Sequence[int], int], int | None],
    compiled: Iterable[tuple[int, int]] = (),
    clients: int | None = None,
    first: tuple[int, int] | None = None,
) -> tuple[tuple[tuple[int, int], ...], tuple[int, int] | None]:
    """The packed layouts (row length, rows) to keep resident for traffic that arrived as ``groups`` (lists of
    calls, each its sequences' lengths), and the *fill* layout among them: the batcher fills each group
    to at most one step of it, so steps run nearly full. First the fill layout
    that serves the traffic at the least cost, then, while slots remain, the layout whose saving over
    ``horizon_calls`` exceeds its compile and load by most (a group's tail). Greedy: the exact choice is a
    set-cover problem, and groups differ from one run to the next anyway. The traffic is replayed as the
    batcher would group it under each fill layout: by ``clients`` callers that wait for their answers
    (``closed_loop``) when the batcher counted them, else as calls arriving in these groups (``refill``),
    each group taking the calls that fill its step best (``group_positions``), in ``REPLAY_ORDERS`` orders
    of the calls (a sample's order is one draw of how they group). A closed-loop replay ends
    where its sample does: the groups formed once the calls ran out are priced by their real positions,
    and the replay's end by half a step, the room a pause in the traffic leaves empty on average, so that
    the choice does not hang on how this sample's last step happened to end.
    ``rows_of(lengths, tokens)``: rows first-fit-decreasing fills (None: a sequence is longer).

    ``first``: the first layout (which holds any group) when it keeps an IPU group of its own. Then the
    fill layout need not hold the rare longest calls: the batcher runs a call the fill layout cannot hold
    alone, and it is served by the first layout (or a planned one that holds it) without a switch, priced
    by the positions it computes there. Without it every planned layout shares the IPUs, so serving a call
    elsewhere would switch executables: the fill layout then holds the longest call seen."""
    calls = sum(len(group) for group in groups)
    if not calls:
        return (), None
    arrivals = [call for group in groups for call in group]
    done = set(compiled)
    per_step = steps_of(1, 1)
    longest = max(n for group in groups for call in group for n in call)
    scale = model.horizon_calls / calls * model.token_seconds

    def packed(group: Sequence[tuple[int, ...]], tokens: Sequence[int]) -> PackedGroup:
        lengths = [n for call in group for n in call]
        return PackedGroup(sum(lengths), {t: rows_of(lengths, t) for t in tokens}, len(group))

    candidates = [(tokens, micro) for tokens in row_lengths for micro in row_counts]
    wider = None if first is None else layout_step(first, per_step, rows_of)

    def left_over(groups_left: Sequence[Sequence[tuple[int, ...]]]) -> float:
        """The least cost of the groups a fill layout cannot hold: on the first layout (resident already),
        or on one more layout that holds them, when a slot remains for it (its compile and load priced)."""
        if not groups_left:
            return 0.0
        options = [(first, 0.0)] if first is not None else []
        if slots > 1:
            options += [(layout, model.executable_seconds(layout in done)) for layout in candidates]
        cheapest = math.inf
        for layout, executable in options:
            costs = [
                layout_cost(packed(g, (layout[0],)), layout, row_counts, steps_of, any_rows=layout == first)
                for g in groups_left
            ]
            if all(cost is not None for cost in costs):
                cheapest = min(cheapest, sum(costs) * scale + executable)
        return cheapest

    # how the batcher groups calls depends on the order they arrive in, and the sample is one order: a
    # closed-loop replay is priced over REPLAY_ORDERS orders of it (the recorded one first, the others
    # seeded by the sample, so that the same record gives the same plan)
    orders = [arrivals]
    if clients is not None:
        shuffle = random.Random(len(arrivals))
        orders += [shuffle.sample(arrivals, len(arrivals)) for _ in range(REPLAY_ORDERS - 1)]

    def replayed(
        tokens: int, micro: int, order: Sequence[tuple[int, ...]]
    ) -> tuple[float, list[list[tuple[int, ...]]]]:
        """The cost of ``order``'s calls served with the fill layout ``(tokens, micro)``, and its groups."""
        fits, step = layout_step((tokens, micro), per_step, rows_of)
        replay = (
            [(group, False) for group in refill(groups, fits, step, wider)]
            if clients is None
            else _closed_loop(order, clients, fits, step, wider)
        )
        computed, groups_left, rooms = 0.0, [], []
        for group, draining in replay:
            cost = layout_cost(packed(group, (tokens,)), (tokens, micro), row_counts, steps_of)
            # the room the group's step can leave empty: the fill layout's, or the first layout's
            rooms.append(step if cost is not None or wider is None else wider[1])
            if cost is None:
                groups_left.append(group)
            elif draining:
                # the replay ends where its sample does, steady traffic does not: these calls would
                # share steps with the calls that follow
                computed += sum(n for call in group for n in call)
            else:
                computed += cost
        if clients is not None and rooms:
            # and where the traffic pauses, its last step leaves half its room empty, expected: priced
            # once per replay, whether or not this sample happened to end on a full step. That step is
            # any group's: on the first layout as often as the groups the fill layout leaves to it
            computed += sum(rooms) / len(rooms) / 2
        return computed * scale + left_over(groups_left), [group for group, _ in replay]

    best: tuple[float, tuple[int, int], list[list[tuple[int, ...]]]] | None = None
    for tokens in (t for t in row_lengths if first is not None or t >= longest):
        for micro in row_counts:
            replays = [replayed(tokens, micro, order) for order in orders]
            total = sum(cost for cost, _ in replays) / len(replays)
            total += model.executable_seconds((tokens, micro) in done)
            if best is None or total < best[0]:
                best = (total, (tokens, micro), replays[0][1])
    if best is None:
        return (), None
    _, fill, formed = best
    priced = [packed(group, row_lengths) for group in formed]
    costs = {
        layout: [
            layout_cost(group, layout, row_counts, steps_of, any_rows=layout == first) for group in priced
        ]
        for layout in {*candidates, *([first] if first is not None else [])}
    }
    serving = () if first is None else (first,)  # resident already: no compile, no slot of the plan's

    def total(chosen: Sequence[tuple[int, int]]) -> float:
        computed = 0.0
        for index in range(len(priced)):
            options = [v for layout in (*chosen, *serving) if (v := costs[layout][index]) is not None]
            computed += min(options, default=math.inf)
        return computed * scale + sum(model.executable_seconds(layout in done) for layout in chosen)

    plan = [fill]
    while len(plan) < slots:
        options = [layout for layout in candidates if layout not in plan]
        if not options:
            break
        current = total(plan)
        added = min(options, key=lambda layout: total([*plan, layout]))
        if total([*plan, added]) >= current:
            break
        plan.append(added)
    return tuple(sorted(plan)), fill
