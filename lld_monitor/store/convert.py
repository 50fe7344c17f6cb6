"""Turning what callers append (Arrow table, pandas DataFrame, dict of columns) into a table of a schema."""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import numpy as np
import pyarrow as pa

from .errors import StoreError


def _column(name: str, value: Any, field: pa.Field, table: str) -> pa.Array | pa.ChunkedArray:
    try:
        if isinstance(value, (pa.Array, pa.ChunkedArray)):
            arr = value
        else:
            if hasattr(value, "to_numpy") and not isinstance(value, np.ndarray):  # pandas Series
                value = value.to_numpy()
            if isinstance(value, np.ndarray) and value.dtype == object:
                value = value.tolist()
            # from_pandas=False: NaN stays NaN (stored faithfully); only None is NULL
            arr = pa.array(value, from_pandas=False)
        if arr.type != field.type:
            if pa.types.is_string(field.type) and not pa.types.is_string(arr.type) and not pa.types.is_null(arr.type):
                arr = pa.array([None if v is None else str(v) for v in arr.to_pylist()], type=pa.string())
            else:
                arr = arr.cast(field.type, safe=True)
        return arr
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, ValueError) as e:
        raise StoreError(
            f"column {name!r} of table {table!r} cannot be stored as {field.type}: {e}. "
            "Pass values of that type (e.g. whole numbers for integer columns)."
        ) from e


def _constant(v: Any, n: int, type_: pa.DataType) -> pa.Array:
    return pa.nulls(n, type_) if v is None else pa.repeat(pa.scalar(v, type=type_), n)


def to_table(
    table: str, rows: Any, schema: pa.Schema, force: dict[str, Any], defaults: dict[str, Any] | None = None
) -> pa.Table:
    """Conform `rows` to `schema`: cast known columns, set `force` columns, fill absent ones from
    `defaults` (else NULL). Unknown columns are an error (nothing is dropped silently)."""
    defaults = defaults or {}
    if isinstance(rows, pa.RecordBatch):
        rows = pa.Table.from_batches([rows])
    if isinstance(rows, pa.Table):
        columns: dict[str, Any] = {n: rows.column(n) for n in rows.column_names}
    elif hasattr(rows, "columns") and hasattr(rows, "to_numpy"):  # pandas DataFrame
        columns = {str(c): rows[c] for c in rows.columns}
    elif isinstance(rows, dict):
        columns = dict(rows)
    else:
        raise StoreError(f"append({table!r}, rows): rows must be a pyarrow Table, a pandas DataFrame or a dict of columns")
    unknown = [c for c in columns if c not in schema.names]
    if unknown:
        raise StoreError(
            f"unknown column(s) {unknown} for table {table!r}; its columns are {schema.names}. "
            "Scalars that are not step signals belong in the 'metrics' table (key, value)."
        )
    n: int | None = None
    arrays: dict[str, Any] = {}
    for name, value in columns.items():
        if name in force:
            continue
        arr = _column(name, value, schema.field(name), table)
        if n is None:
            n = len(arr)
        elif len(arr) != n:
            raise StoreError(f"table {table!r}: column {name!r} has {len(arr)} rows, others have {n}")
        arrays[name] = arr
    n = n or 0
    out = []
    for field in schema:
        if field.name in force:
            out.append(_constant(force[field.name], n, field.type))
        elif field.name in arrays:
            out.append(arrays[field.name])
        else:
            out.append(_constant(defaults.get(field.name), n, field.type))
    return pa.Table.from_arrays(out, schema=schema)


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """An older segment in the current schema: absent columns become NULL (column-add migrations)."""
    if table.schema.equals(schema):
        return table
    cols = []
    for field in schema:
        if field.name in table.column_names:
            col = table.column(field.name)
            cols.append(col if col.type == field.type else col.cast(field.type))
        else:
            cols.append(pa.nulls(table.num_rows, field.type))
    return pa.Table.from_arrays(cols, schema=schema)


@functools.cache
def schema_fingerprint(table: str) -> str:
    """Short hash of a table's current column names and types; segments carry it in the manifest so a
    reader knows when every segment has exactly the current schema (no NULL-filling needed)."""
    from .schema import TABLES

    text = ",".join(f"{f.name}:{f.type}" for f in TABLES[table])
    return hashlib.sha1(text.encode()).hexdigest()[:12]
