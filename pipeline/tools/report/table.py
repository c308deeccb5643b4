"""The per-epoch numbers of a run log, stored by column: one typed array a value name, one row an
epoch, so a 200,000-epoch log costs a few MB, not a dict per epoch.

A value is a metric (``metric``), a slot or one key of a mapping slot (``slot``: ``max_grad_norm``,
``loss_prediction.predicted_loss``), the epoch's seconds (``time``), a phase's or a callback's
seconds (``phase``, ``callback``). Missing stays distinct from NaN. An epoch logged twice (a
resumed run re-runs the epochs after its checkpoint) keeps only its last record.
"""

from __future__ import annotations

from array import array

__all__ = ["Column", "EpochTable"]


class Column:
    """One value per row: ``values`` (float64) and whether each row has one (``present``). Both may
    run longer than the table's rows (room to grow); only the table's rows count."""

    __slots__ = ("present", "values")

    def __init__(self, capacity: int) -> None:
        self.values = array("d", bytes(8 * capacity))
        self.present = bytearray(capacity)

    def widen(self, extra: int) -> None:
        self.values.extend(array("d", bytes(8 * extra)))
        self.present.extend(bytes(extra))

    def as_list(self, rows: int) -> list[float | None]:
        return [v if p else None for v, p in zip(self.values[:rows], self.present[:rows], strict=True)]

    def total(self, rows: int) -> float:
        return sum(v for v, p in zip(self.values[:rows], self.present[:rows], strict=True) if p)

    def reorder(self, order: list[int] | None, rows: int) -> None:
        """Keep the first ``rows`` rows, in ``order`` when given."""
        values, present = self.values, self.present
        if order is None:
            self.values, self.present = values[:rows], present[:rows]
            return
        self.values = array("d", (values[i] for i in order))
        self.present = bytearray(present[i] for i in order)


class EpochTable:
    """Rows by epoch index (0-based, as the log has it), columns by kind and name."""

    def __init__(self) -> None:
        self.index: list[int] = []
        self._row_of: dict[int, int] = {}
        self._all: list[Column] = []
        self._capacity = 1024
        self.columns: dict[str, dict[str, Column]] = {}  # kind -> name -> column

    def __len__(self) -> int:
        return len(self.index)

    def row(self, epoch: int) -> int:
        """The row of ``epoch``, emptied for its (new or repeated) record."""
        row = self._row_of.get(epoch)
        if row is None:
            row = self._row_of[epoch] = len(self.index)
            self.index.append(epoch)
            if row == self._capacity:  # room doubles: a row costs no work per column
                for column in self._all:
                    column.widen(self._capacity)
                self._capacity *= 2
        else:
            for column in self._all:
                column.present[row] = 0
        return row

    def kind(self, kind: str) -> dict[str, Column]:
        """The columns of ``kind``, by name (made empty on first use)."""
        return self.columns.setdefault(kind, {})

    def add(self, columns: dict[str, Column], name: str) -> Column:
        """A new, empty column ``name`` in ``columns`` (one of :meth:`kind`)."""
        column = columns[name] = Column(self._capacity)
        self._all.append(column)
        return column

    def finish(self) -> None:
        """Rows in epoch order (a log writes them so, unless a resume re-ran some), no spare room."""
        rows = len(self.index)
        order: list[int] | None = None
        if any(a > b for a, b in zip(self.index, self.index[1:], strict=False)):
            order = sorted(range(rows), key=self.index.__getitem__)
            self.index = [self.index[i] for i in order]
            self._row_of = {e: r for r, e in enumerate(self.index)}
        for column in self._all:
            column.reorder(order, rows)
        self._capacity = rows

    def values(self, kind: str, name: str) -> list[float | None]:
        column = self.columns.get(kind, {}).get(name)
        return column.as_list(len(self.index)) if column is not None else [None] * len(self.index)

    def names(self, kind: str) -> list[str]:
        """The names of ``kind`` in the order they first appeared."""
        return list(self.columns.get(kind, {}))

    def totals(self, kind: str) -> dict[str, float]:
        return {name: column.total(len(self.index)) for name, column in self.columns.get(kind, {}).items()}
