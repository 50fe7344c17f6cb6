"""The steps a segment holds, written into its manifest entry so a reader lists them without reading Parquet.

A set of steps is stored as arithmetic runs `[first, last, stride]`: tokens logged every step, every 10th step
or on a few chosen steps all stay a few numbers long, however long the run. `compress` and `expand` are exact
inverses on sorted, distinct steps (tested); a segment entry without `steps` (stores written before this
existed) is read the slow way, by the reader's DISTINCT over that segment.
"""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa
import pyarrow.compute as pc


def compress(steps: Iterable[int]) -> list[list[int]]:
    """Distinct steps (any order) -> arithmetic runs [first, last, stride], greedily from the smallest step."""
    s = sorted({int(x) for x in steps})
    runs: list[list[int]] = []
    i = 0
    while i < len(s):
        if i + 1 == len(s):
            runs.append([s[i], s[i], 1])
            break
        stride = s[i + 1] - s[i]
        j = i + 1
        while j + 1 < len(s) and s[j + 1] - s[j] == stride:
            j += 1
        runs.append([s[i], s[j], stride])
        i = j + 1
    return runs


def expand(runs: Iterable[Iterable[int]]) -> list[int]:
    """Arithmetic runs -> the sorted distinct steps they stand for."""
    out: set[int] = set()
    for first, last, stride in runs:
        if stride <= 0 or last < first:
            raise ValueError(f"not a step run: {[first, last, stride]} (want first <= last, stride > 0)")
        out.update(range(first, last + 1, stride))
    return sorted(out)


def of_table(table: pa.Table | pa.RecordBatch) -> set[int]:
    """The distinct steps in a table's `step` column (nulls are refused by the writer before this)."""
    return {int(v) for v in pc.unique(table.column("step")).to_pylist() if v is not None}
