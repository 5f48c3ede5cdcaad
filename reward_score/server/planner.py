"""How the server batches (no torch): which waiting rows go into one forward (`Planner.plan`), and its padded width
and whether its sequences are packed several to a row (`Planner.layout`). The runner runs what these return."""

import math
from collections.abc import Sequence
from dataclasses import dataclass

from reward_score.server.settings import Settings

PACK_WHEN = 0.8  # pack a micro-batch's sequences several to a row when that needs at most 80% of the rows
# What one more forward costs beyond its tokens, in tokens (launches, smaller matmuls): about 3% of a 32k-token
# micro-batch of a Qwen3-1.7B. A bigger model's token takes longer, so it is fewer of its tokens on a GPU.
MICRO_BATCH_COST = 1024
MICRO_BATCH_COST_PARAMS = 1.5e9  # non-embedding parameters up to which it holds (measured on Qwen3-1.7B: 1.41e9)
MIN_MICRO_BATCH_COST = 64
# Packing up to this size: a packed row attends over its whole width (no causal skipping), which costs a bigger model
# more than the padding it saves (benchmarks/README.md).
PACK_UP_TO_PARAMS = MICRO_BATCH_COST_PARAMS
# The token budget on a GPU (a larger one made fresh lengths and per-sample callers slower on an H200, 1.7B to 14B),
# and the memory its activations may take when nothing caps the server.
DEFAULT_GPU_BUDGET = 32768
DEFAULT_ACTIVATION_BYTES = 8 * 2**30
MIN_BUDGET = 1024
# Activations measured against this estimate (H200, per-layer compile): 1.7B 1.8 GiB at 32k tokens for 1.9 estimated,
# 8B 3.3 for 3.6, 14B 4.4 for 4.9. The margin covers the allocator's rounding and the next micro-batch's inputs.
ACTIVATION_MARGIN = 1.25


def activation_bytes_per_token(
    hidden: int, intermediate: int, q_width: int, kv_width: int, dtype_bytes: int = 2
) -> int:
    """One token's activations at the peak of a layer's forward: the residual in and out, its normed copy and the
    attention output (4 x hidden), q, k and v, and the MLP's gate, up and their product (3 x intermediate)."""
    return dtype_bytes * (4 * hidden + q_width + 2 * kv_width + 3 * intermediate)


class MemoryTooSmall(ValueError):
    """REWARD_GPU_MEMORY_GIB leaves the activations too little room."""


def model_token_budget(per_token_bytes: int, weight_bytes: int, memory_cap_bytes: int = 0) -> int:
    """`DEFAULT_GPU_BUDGET`, or less where a full micro-batch's activations would not fit beside the weights under the
    cap (in `DEFAULT_ACTIVATION_BYTES` without one), in multiples of `MIN_BUDGET`."""
    room = memory_cap_bytes - weight_bytes if memory_cap_bytes else DEFAULT_ACTIVATION_BYTES
    fits = int(room / (ACTIVATION_MARGIN * per_token_bytes)) // MIN_BUDGET * MIN_BUDGET
    if fits < MIN_BUDGET:
        need = (weight_bytes + ACTIVATION_MARGIN * per_token_bytes * MIN_BUDGET) / 2**30
        raise MemoryTooSmall(
            f"REWARD_GPU_MEMORY_GIB={memory_cap_bytes / 2**30:g}: the weights take {weight_bytes / 2**30:.1f} GiB, "
            f"which leaves no room for a {MIN_BUDGET}-token micro-batch; give the server at least {need:.1f} GiB"
        )
    return min(DEFAULT_GPU_BUDGET, fits)


def model_micro_batch_cost(non_embedding_params: float) -> int:
    """MICRO_BATCH_COST up to Qwen3-1.7B's size, less in proportion to a token's time above it (Qwen3-8B: ~200)."""
    scaled = MICRO_BATCH_COST * MICRO_BATCH_COST_PARAMS / max(non_embedding_params, 1.0)
    return int(max(MIN_MICRO_BATCH_COST, min(MICRO_BATCH_COST, scaled)))


def model_packs(non_embedding_params: float) -> bool:
    """Whether REWARD_PACK=auto packs for a model of this size (see PACK_UP_TO_PARAMS)."""
    return non_embedding_params <= PACK_UP_TO_PARAMS


class _Packer:
    """First-fit decreasing: sequences, fed longest first, go into the first row of `width` tokens with room left."""

    def __init__(self, width: int):
        self.width = width
        self.rooms: list[int] = []
        self.bins: list[list[int]] = []
        self.max_room = 0

    def slot(self, n: int) -> int:
        """The row a sequence of n tokens would go to (len(rooms): a new one)."""
        if n <= self.max_room:
            for b, room in enumerate(self.rooms):
                if n <= room:
                    return b
        return len(self.rooms)

    def add(self, i: int, n: int, slot: int) -> None:
        if slot == len(self.rooms):
            self.rooms.append(self.width - n)
            self.bins.append([i])
            self.max_room = max(self.max_room, self.width - n)
            return
        emptiest = self.rooms[slot] == self.max_room
        self.rooms[slot] -= n
        self.bins[slot].append(i)
        if emptiest:
            self.max_room = max(self.rooms)


@dataclass(frozen=True)
class Layout:
    """One micro-batch as it runs: rows of `width` tokens; `bins`, per row, the sequences packed into it (None: one
    sequence a row, padded on the right)."""

    width: int
    bins: list[list[int]] | None


@dataclass(frozen=True)
class Planner:
    """The batching policy. `pack`: the model can take several sequences to a row (the runner says whether)."""

    token_budget: int
    max_batch_rows: int = 256
    pad_multiple: int = 16
    max_length: int = 4096
    pack: bool = False
    micro_batch_cost: int = MICRO_BATCH_COST  # tokens: what one more forward costs (see MICRO_BATCH_COST)

    @classmethod
    def for_settings(
        cls, settings: Settings, device: str, pack: bool, model_budget: int | None = None, model_cost: int | None = None
    ) -> "Planner":
        return cls(
            token_budget=(model_budget or DEFAULT_GPU_BUDGET) if device.startswith("cuda") else 8192,
            max_length=settings.max_length,
            pack=pack,
            micro_batch_cost=settings.micro_batch_cost or model_cost or MICRO_BATCH_COST,
        )

    def plan(self, lengths: Sequence[int]) -> list[list[int]]:
        """Row indices in micro-batches within the token budget as run: the cheaper (tokens plus `micro_batch_cost`
        each) of filling each up to the budget, packing where it saves a fifth of the rows (`_fill`), and cutting the
        length-sorted rows where the fewest padded tokens are computed (`_partition`)."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        if not order:
            return []
        filled, filled_cost = self._fill(order, lengths)
        cut, cut_cost = self._partition(order, lengths)
        return cut if cut_cost < filled_cost else filled

    def _fill(self, order: list[int], lengths: Sequence[int]) -> tuple[list[list[int]], int]:
        batches: list[list[int]] = []
        cost = 0
        current: list[int] = []
        packer: _Packer | None = None
        as_run = 0  # the current micro-batch's rows as it will run (packed rows count once)
        for i in order:
            if packer is not None and len(current) < self.max_batch_rows:
                slot = packer.slot(lengths[i])
                bins = len(packer.rooms) + (slot == len(packer.rooms))
                rows = bins if self.pack and bins <= PACK_WHEN * (len(current) + 1) else len(current) + 1
                if rows * packer.width <= self.token_budget:
                    current.append(i)
                    packer.add(i, lengths[i], slot)
                    as_run = rows
                    continue
            if current:
                batches.append(current)
                cost += as_run * packer.width + self.micro_batch_cost
            current, packer, as_run = [i], _Packer(self.width_for(lengths[i])), 1
            packer.add(i, lengths[i], 0)
        batches.append(current)
        cost += as_run * packer.width + self.micro_batch_cost
        return batches, cost

    def _partition(self, order: list[int], lengths: Sequence[int]) -> tuple[list[list[int]], int]:
        """A shortest path over cut points of the length-sorted rows; a micro-batch ends where the padded width changes
        or the budget is full, so each start tries few ends."""
        widths = [self.width_for(lengths[i]) for i in order]
        n = len(order)
        next_width = [n] * n  # the first position after k with another padded width
        for k in range(n - 2, -1, -1):
            next_width[k] = k + 1 if widths[k + 1] != widths[k] else next_width[k + 1]
        best = [0] + [math.inf] * n
        came_from = [0] * (n + 1)
        for i in range(n):
            width = widths[i]
            last = min(n, i + max(1, min(self.max_batch_rows, self.token_budget // width)))
            j = next_width[i]
            while True:
                j = min(j, last)
                cost = best[i] + (j - i) * width + self.micro_batch_cost
                if cost < best[j]:
                    best[j], came_from[j] = cost, i
                if j == last:
                    break
                j = next_width[j]
        batches = []
        j = n
        while j:
            i = came_from[j]
            batches.append(order[i:j])
            j = i
        return batches[::-1], int(best[n])

    def layout(self, lengths: Sequence[int]) -> Layout:
        """Packed where that needs at most `PACK_WHEN` of the rows, else one padded row each."""
        width = self.width_for(max(lengths))
        if self.pack and len(lengths) > 1:
            packer = _Packer(width)
            for k in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
                packer.add(k, lengths[k], packer.slot(lengths[k]))
            if len(packer.bins) <= PACK_WHEN * len(lengths):
                return Layout(width, packer.bins)
        return Layout(width, None)

    def width_for(self, longest: int) -> int:
        """A multiple of `pad_multiple` (fewer shapes to compile), never over max_length unless the row is."""
        padded = max(self.pad_multiple, math.ceil(longest / self.pad_multiple) * self.pad_multiple)
        return min(padded, max(longest, self.max_length))
