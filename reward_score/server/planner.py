"""How the server batches: which waiting rows go into one forward, and how that forward lays them out. No torch.

Two decisions, both here:
- `Planner.plan`: group rows into micro-batches, longest first, each within the token budget as it will run;
- `Planner.layout`: for one micro-batch, its padded width and whether its sequences are packed several to a row.
The runner (runner.py) runs what these return and decides nothing itself; the batcher (batcher.py) decides when to
launch and which of the planned micro-batches goes next.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

from reward_score.server.settings import Settings

PACK_WHEN = 0.8  # pack a micro-batch's sequences several to a row when that needs at most 80% of the rows


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
    """One micro-batch as it runs: rows of `width` tokens. `bins` lists, per row, the positions (in the micro-batch)
    of the sequences packed into it; None means one sequence per row, padded on the right."""

    width: int
    bins: list[list[int]] | None


@dataclass(frozen=True)
class Planner:
    """The batching policy. `pack`: the model can take several sequences to a row (the runner says whether)."""

    token_budget: int
    max_batch_rows: int = 256
    pad_multiple: int = 64
    max_length: int = 4096
    pack: bool = False

    @classmethod
    def for_settings(cls, settings: Settings, device: str, pack: bool) -> "Planner":
        return cls(
            token_budget=settings.effective_token_budget(device),
            max_batch_rows=settings.max_batch_rows,
            pad_multiple=settings.pad_multiple,
            max_length=settings.max_length,
            pack=pack,
        )

    def plan(self, lengths: Sequence[int]) -> list[list[int]]:
        """Group row indices into micro-batches, longest first, each within the token budget as it will run: padded
        rows, or rows packed several to a padded row where that saves at least a fifth of the rows (`_Packer`)."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        batches: list[list[int]] = []
        current: list[int] = []
        packer: _Packer | None = None
        for i in order:
            if packer is not None and len(current) < self.max_batch_rows:
                slot = packer.slot(lengths[i])
                bins = len(packer.rooms) + (slot == len(packer.rooms))
                if self.pack and bins <= PACK_WHEN * (len(current) + 1):
                    rows = bins
                else:
                    rows = len(current) + 1
                if rows * packer.width <= self.token_budget:
                    current.append(i)
                    packer.add(i, lengths[i], slot)
                    continue
            if current:
                batches.append(current)
            current, packer = [i], _Packer(self.width_for(lengths[i]))
            packer.add(i, lengths[i], 0)
        if current:
            batches.append(current)
        return batches

    def layout(self, lengths: Sequence[int]) -> Layout:
        """How one micro-batch of sequences of these lengths runs: packed where that needs at most `PACK_WHEN` of
        the rows, else one padded row each."""
        width = self.width_for(max(lengths))
        if self.pack and len(lengths) > 1:
            packer = _Packer(width)
            for k in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
                packer.add(k, lengths[k], packer.slot(lengths[k]))
            if len(packer.bins) <= PACK_WHEN * len(lengths):
                return Layout(width, packer.bins)
        return Layout(width, None)

    def padded_length(self, n: int) -> int:
        m = self.pad_multiple
        return max(m, math.ceil(n / m) * m)

    def width_for(self, longest: int) -> int:
        """The padded width of a micro-batch whose longest row has `longest` tokens."""
        return min(self.padded_length(longest), max(longest, self.max_length))
