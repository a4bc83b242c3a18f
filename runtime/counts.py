"""How many microbatches a batch runs with: the compiled count, or fewer for a short batch.

[Note: short batch]
    A package is compiled for M microbatches per replica, but a batch may have any size the
    data-parallel degree divides (the contract's "any batch"), a short last batch included.
    A replica of R < M rows runs with the largest count c <= R whose schedule the package's
    schedule builder makes and `validate` accepts (interleaved needs a multiple of the
    ranks, so it may run fewer than R); each count's lowered schedule is built once and
    kept.  Nothing else changes: the rows are cut by `torch.tensor_split` into c pieces and
    weighted by [Note: microbatch weights], so the loss and gradients are still the whole
    batch's, exactly.  Every rank derives c from the batch's shape alone, so all agree.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

from .errors import BatchError, ScheduleError

__all__ = ["Counts"]

T = TypeVar("T")


class Counts(Generic[T]):
    """What `build(count)` makes (a lowered schedule), for the compiled count and, on a short
    batch, the largest smaller one it can make ([Note: short batch]); each built once."""

    def __init__(self, build: Callable[[int], T], compiled: int, fixed: bool = False) -> None:
        self._build, self.compiled, self._fixed = build, compiled, fixed
        self._made: dict[int, T | ScheduleError] = {}
        self.get(compiled)  # a package whose own schedule is wrong fails at once

    def get(self, count: int) -> T:
        """The schedule for `count` microbatches (ScheduleError when there is none)."""
        if count not in self._made:
            try:
                self._made[count] = self._build(count)
            except ScheduleError as exc:
                self._made[count] = exc
        made = self._made[count]
        if isinstance(made, ScheduleError):
            raise made
        return made

    def fit(self, rows: int | None) -> int:
        """The count for a replica of `rows` rows (None: no batched input, the compiled one)."""
        if rows is None or rows >= self.compiled:
            return self.compiled
        why: list[str] = []
        for count in range(rows, 0, -1) if not self._fixed else ():
            try:
                self.get(count)
                return count
            except ScheduleError as exc:
                why.append(str(exc))
        how = ("the schedule was given as a fixed list of actions" if self._fixed else
               f"the package's schedule runs with no count that small ({why[0] if why else 'no rows'})")
        raise BatchError(f"the batch has {rows} rows per replica, fewer than the package's {self.compiled} "
                         f"microbatches, and {how}: give at least {self.compiled} rows per replica, or compile "
                         f"with fewer --microbatches.")
