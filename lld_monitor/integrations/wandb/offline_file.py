"""Read a W&B offline run (`wandb/offline-run-*/run-<id>.wandb`) without the W&B service or network.

wandb >= 0.30 no longer ships `wandb.sdk.internal.datastore`, so this module reads the record log itself.
The file is a leveldb-log container:

- a 7-byte file header ``"<4sHB"`` = ``b":W&B"``, magic ``0xBEE1``, version ``0``;
- 32 KiB blocks; fewer than 7 bytes left in a block are zero padding;
- each physical record has a 7-byte header ``"<IHB"`` = (crc32, length, type) with
  ``crc = zlib.crc32(data, zlib.crc32(bytes([type])))``; types FULL=1, FIRST=2, MIDDLE=3, LAST=4
  (a logical record larger than a block is split FIRST, MIDDLE..., LAST);
- every logical record is a protobuf ``wandb.proto.wandb_internal_pb2.Record``.

Robustness rules (a run may still be being written, or its file may be damaged):
- a record whose header or payload runs past the end of the file is a *partial tail*: reading stops there
  and everything before it is kept (``WandbRunData.truncated``);
- a CRC mismatch or an impossible record header skips to the next block, as leveldb's reader does, and is
  counted in ``WandbRunData.problems``; no record after a skipped fragment is glued to a wrong prefix;
- a file that does not start with the W&B header raises :class:`NotAWandbFileError` (nothing is read).

A run is complete only once its ``exit`` record is present (``WandbRunData.complete``).
"""

from __future__ import annotations

import json
import logging
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FILE_HEADER = struct.Struct("<4sHB")
FILE_IDENT = b":W&B"
FILE_MAGIC = 0xBEE1
FILE_VERSION = 0
RECORD_HEADER = struct.Struct("<IHB")
BLOCK_SIZE = 32 * 1024
HEADER_SIZE = 7

FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
_NAN = float("nan")


class NotAWandbFileError(ValueError):
    """The file is not a W&B record log (wrong header)."""


@dataclass
class ScanStats:
    records: int = 0
    crc_errors: int = 0
    bad_headers: int = 0
    orphan_fragments: int = 0
    truncated: bool = False  # a partial record at the end of the file (still being written, or cut)
    problems: list[str] = field(default_factory=list)


def _crc(record_type: int, data: bytes) -> int:
    return zlib.crc32(data, zlib.crc32(bytes([record_type]))) & 0xFFFFFFFF


def iter_record_payloads(data: bytes, stats: ScanStats | None = None) -> Iterator[bytes]:
    """Yield the logical record payloads of a `.wandb` byte string (header included), checking CRCs."""
    stats = stats if stats is not None else ScanStats()
    if len(data) < HEADER_SIZE:
        raise NotAWandbFileError(f"file is {len(data)} bytes, shorter than the 7-byte W&B header")
    ident, magic, version = FILE_HEADER.unpack_from(data, 0)
    if ident != FILE_IDENT or magic != FILE_MAGIC:
        raise NotAWandbFileError(
            f"not a W&B run file (header {data[:7]!r}; expected b':W&B' and magic 0xBEE1)"
        )
    if version != FILE_VERSION:
        stats.problems.append(f"unknown .wandb format version {version}; reading it as version 0")
    pos = HEADER_SIZE
    end = len(data)
    pending: bytearray | None = None
    while pos < end:
        left_in_block = BLOCK_SIZE - pos % BLOCK_SIZE
        if left_in_block < HEADER_SIZE:
            pos += left_in_block  # zero padding at the end of a block
            continue
        if pos + HEADER_SIZE > end:
            stats.truncated = True
            break
        crc, length, rtype = RECORD_HEADER.unpack_from(data, pos)
        if rtype == 0 and length == 0 and crc == 0:
            # preallocated / zero-filled space: nothing more was written in this block
            pos += left_in_block
            pending = None
            continue
        if rtype not in (FULL, FIRST, MIDDLE, LAST) or HEADER_SIZE + length > left_in_block:
            stats.bad_headers += 1
            stats.problems.append(f"bad record header at byte {pos}; skipped to the next block")
            pos += left_in_block
            pending = None
            continue
        if pos + HEADER_SIZE + length > end:
            stats.truncated = True
            break
        chunk = data[pos + HEADER_SIZE : pos + HEADER_SIZE + length]
        pos += HEADER_SIZE + length
        if _crc(rtype, chunk) != crc:
            stats.crc_errors += 1
            stats.problems.append(f"CRC mismatch in record ending at byte {pos}; skipped to the next block")
            pos += BLOCK_SIZE - pos % BLOCK_SIZE if pos % BLOCK_SIZE else 0
            pending = None
            continue
        if rtype == FULL:
            if pending is not None:
                stats.orphan_fragments += 1
                pending = None
            stats.records += 1
            yield bytes(chunk)
        elif rtype == FIRST:
            if pending is not None:
                stats.orphan_fragments += 1
            pending = bytearray(chunk)
        elif rtype == MIDDLE:
            if pending is None:
                stats.orphan_fragments += 1
            else:
                pending += chunk
        else:  # LAST
            if pending is None:
                stats.orphan_fragments += 1
            else:
                pending += chunk
                stats.records += 1
                yield bytes(pending)
                pending = None
    if pending is not None:
        stats.truncated = True  # a FIRST/MIDDLE without its LAST: the writer has not finished it
    if stats.orphan_fragments:
        stats.problems.append(f"{stats.orphan_fragments} record fragment(s) without their neighbours dropped")
    if stats.truncated:
        stats.problems.append("partial record at the end of the file (run still being written, or file cut)")


@dataclass
class WandbRunData:
    """Everything the importer needs from one `.wandb` file (or several merged resume segments)."""

    path: Path
    run_id: str | None = None
    name: str | None = None
    project: str | None = None
    entity: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)  # flat key -> decoded JSON value, has "_step"
    summary: dict[str, Any] = field(default_factory=dict)  # only with read_wandb_file(summary=True)
    start_time: datetime | None = None
    complete: bool = False  # an exit record was read
    exit_code: int | None = None
    truncated: bool = False
    problems: list[str] = field(default_factory=list)
    record_types: dict[str, int] = field(default_factory=dict)


def _item_key(item: Any) -> str:
    nested = item.nested_key
    if len(nested) == 1:
        return nested[0]
    if nested:
        return ".".join(nested)
    return item.key


def _collapse_media(row: dict[str, Any]) -> None:
    """W&B writes a media value (table, image, histogram) as nested items `<key>._type`, `<key>.path`...;
    put them back together as one dict under `<key>`, as the online API returns them (so the importer
    sees one non-scalar value, not a handful of numeric-looking fields such as `<key>.size`)."""
    prefixes = [k[: -len("._type")] for k in row if k.endswith("._type")]
    for p in prefixes:
        head = p + "."
        obj = {k[len(head):]: row.pop(k) for k in [k for k in row if k.startswith(head)]}
        row[p] = obj


def _locate_media_files(row: dict[str, Any], files_dir: Path) -> None:
    """A media value saved as a file (a W&B table: `{"_type": "table-file", "path": "media/table/..."}`) gets
    `_file`, the absolute path of that file in the run folder, so the importer can read it (TRL's
    `completions` table lands in `samples`)."""
    for v in row.values():
        if isinstance(v, dict) and isinstance(v.get("path"), str) and "_type" in v:
            v["_file"] = str(files_dir / v["path"])


def decode_value(value_json: str) -> Any:
    """Decode a W&B `value_json` (JSON with NaN / Infinity / -Infinity allowed).

    Numbers (nearly every history value) take a fast path: int() / float() accept exactly the number
    literals W&B writes, including NaN, Infinity and -Infinity; anything else goes through json.loads."""
    try:
        v = float(value_json)
    except ValueError:
        return json.loads(value_json)  # strings, objects (media), lists, true / false / null
    if v != v:
        return _NAN  # one shared NaN object, as json.loads gives (rows compare equal)
    if v.is_integer() and value_json.lstrip("-").isdigit():
        return int(value_json)  # JSON integers stay ints (exact beyond 2**53)
    return v


def _load_pb():
    try:
        from wandb.proto import wandb_internal_pb2  # noqa: PLC0415  (import on demand: ~0.5 s)
    except ImportError as exc:  # pragma: no cover - wandb is pinned in requirements.txt
        raise RuntimeError("reading .wandb files needs the `wandb` package (pip install -r requirements.txt)") from exc
    return wandb_internal_pb2


def read_wandb_file(path: str | Path, *, summary: bool = False) -> WandbRunData:
    """Parse one `.wandb` record log. Raises NotAWandbFileError for a foreign file, FileNotFoundError if absent.

    `summary=True` also decodes the run summary (W&B rewrites it at every logged step, so it costs about
    as much as the history itself; the importer does not need it)."""
    path = Path(path)
    data = path.read_bytes()
    pb = _load_pb()
    out = WandbRunData(path=path)
    stats = ScanStats()
    summary_raw: dict[str, str] = {}
    for payload in iter_record_payloads(data, stats):
        rec = pb.Record()
        try:
            rec.ParseFromString(payload)
        except Exception as exc:  # protobuf DecodeError: CRC was fine, so the writer produced it; keep going
            out.problems.append(f"undecodable record skipped: {exc}")
            continue
        kind = rec.WhichOneof("record_type")
        if kind is None:
            continue
        out.record_types[kind] = out.record_types.get(kind, 0) + 1
        if kind == "history":
            row: dict[str, Any] = {}
            for item in rec.history.item:
                try:
                    row[_item_key(item)] = decode_value(item.value_json)
                except ValueError:
                    out.problems.append(f"history value for {_item_key(item)!r} is not JSON; skipped")
            _collapse_media(row)
            _locate_media_files(row, path.parent / "files")
            if "_step" not in row and rec.history.HasField("step"):
                row["_step"] = rec.history.step.num
            out.history.append(row)
        elif kind == "run":
            r = rec.run
            out.run_id = r.run_id or out.run_id
            out.name = r.display_name or out.name
            out.project = r.project or out.project
            out.entity = r.entity or out.entity
            if r.HasField("start_time") and out.start_time is None:
                out.start_time = datetime.fromtimestamp(
                    r.start_time.seconds + r.start_time.nanos / 1e9, tz=timezone.utc
                )
            _apply_config(out.config, r.config.update, r.config.remove, out.problems)
        elif kind == "config":
            _apply_config(out.config, rec.config.update, rec.config.remove, out.problems)
        elif kind == "summary" and summary:
            for item in rec.summary.update:  # one per logged step: keep the text, decode the last at the end
                summary_raw[_item_key(item)] = item.value_json
        elif kind == "exit":
            out.complete = True
            out.exit_code = int(rec.exit.exit_code)
    for k, v in summary_raw.items():
        try:
            out.summary[k] = decode_value(v)
        except ValueError:
            pass
    _collapse_media(out.summary)  # a table in the summary is one value, not numeric-looking fields
    out.truncated = stats.truncated
    out.problems = stats.problems + out.problems
    out.config.pop("_wandb", None)
    for p in out.problems:
        log.warning("%s: %s", path, p)
    return out


def _apply_config(config: dict[str, Any], updates: Any, removes: Any, problems: list[str]) -> None:
    for item in updates:
        key_path = list(item.nested_key) or [item.key]
        try:
            value = decode_value(item.value_json)
        except ValueError:
            problems.append(f"config value for {'.'.join(key_path)!r} is not JSON; skipped")
            continue
        node = config
        for k in key_path[:-1]:
            nxt = node.get(k)
            if not isinstance(nxt, dict):
                nxt = node[k] = {}
            node = nxt
        node[key_path[-1]] = value
    for item in removes:
        key_path = list(item.nested_key) or [item.key]
        node = config
        for k in key_path[:-1]:
            node = node.get(k, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(key_path[-1], None)


# --------------------------------------------------------------------------------------------- folders


def find_run_files(root: str | Path) -> list[Path]:
    """All `.wandb` files under `root`: a `.wandb` file itself, a run folder, or a `wandb/` folder.

    `latest-run` symlinks are skipped so a run is not found twice.
    """
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist; pass a wandb/ folder, a run folder or a .wandb file")
    if root.is_file():
        return [root]
    found: list[Path] = []
    for p in sorted(root.rglob("*.wandb")):
        if any(part == "latest-run" for part in p.relative_to(root).parts):
            continue
        found.append(p)
    return found


STEP_AXES = ("lld/step", "train/global_step")  # the run's own optimizer-step keys (signals.LLD_STEP_KEY / TRL_STEP_KEY)


def _own_step_axis(parts: list[WandbRunData]) -> str | None:
    for axis in STEP_AXES:
        if any(axis in row for p in parts for row in p.history):
            return axis
    return None


def merge_segments(parts: list[WandbRunData]) -> WandbRunData:
    """Merge the files of one run id (a run resumed offline writes a second folder with the same id).

    Segments are ordered by start time; config and summary are updated in order. History rows are merged on
    the run's real step axis, never overwritten without a word:
    - a run that logs its own step (`train/global_step` from transformers' WandbCallback, `lld/step` from our
      exporter) keeps every row of every segment in order; the importer merges them on that key;
    - otherwise `_step`: a segment that starts again at `_step` 0 after an earlier segment (a resume without
      `step=`, W&B's offline counter restarts) is shifted to continue after the previous segment, and the
      shift is reported in `problems`; a segment that logs an already-logged `_step` again with an explicit
      `step=` (a replay from a checkpoint) replaces those rows, also reported with the count.
    """
    if len(parts) == 1:
        return parts[0]
    parts = sorted(parts, key=lambda p: (p.start_time or datetime.min.replace(tzinfo=timezone.utc), str(p.path)))
    merged = WandbRunData(path=parts[-1].path)
    axis = _own_step_axis(parts)
    by_step: dict[Any, dict[str, Any]] = {}
    ordered: list[dict[str, Any]] = []
    unstepped: list[dict[str, Any]] = []
    last: int | None = None  # highest `_step` of the segments merged so far
    for p in parts:
        merged.run_id = p.run_id or merged.run_id
        merged.name = p.name or merged.name
        merged.project = p.project or merged.project
        merged.entity = p.entity or merged.entity
        merged.start_time = merged.start_time or p.start_time
        _deep_update(merged.config, p.config)
        merged.summary.update(p.summary)
        merged.problems.extend(f"{p.path.name}: {m}" for m in p.problems)
        for k, v in p.record_types.items():
            merged.record_types[k] = merged.record_types.get(k, 0) + v
        if axis is not None:
            ordered.extend(p.history)
            continue
        steps = [r["_step"] for r in p.history if isinstance(r.get("_step"), int)]
        offset = 0
        if steps and last is not None and min(steps) == 0:
            offset = last + 1
            merged.problems.append(
                f"{p.path.name}: resumed segment restarts _step at 0 (logged without step=); its {len(steps)} "
                f"row(s) continue after step {last} (steps {offset}..{offset + max(steps)})"
            )
        replaced = 0
        for row in p.history:
            step = row.get("_step")
            if not isinstance(step, int):
                unstepped.append(row)
                continue
            if offset:
                row = {**row, "_step": step + offset}
                step += offset
            if step in by_step:
                replaced += 1
            by_step[step] = row
        if replaced:
            merged.problems.append(
                f"{p.path.name}: resumed segment logs {replaced} step(s) again with explicit step=; "
                "the later rows replace the earlier ones (what W&B shows after a resume)"
            )
        if steps:
            last = max(last if last is not None else -1, max(steps) + offset)
    merged.history = ordered if axis is not None else [by_step[s] for s in sorted(by_step)] + unstepped
    tail = parts[-1]
    merged.complete, merged.exit_code, merged.truncated = tail.complete, tail.exit_code, tail.truncated
    return merged


def _deep_update(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_update(dst[k], v)
        else:
            dst[k] = v


def read_offline_runs(root: str | Path) -> list[WandbRunData]:
    """Read every run under `root`, merging resume segments of the same run id. Foreign files are skipped
    with a warning (they are never modified)."""
    groups: dict[str, list[WandbRunData]] = {}
    for f in find_run_files(root):
        try:
            data = read_wandb_file(f, summary=True)
        except NotAWandbFileError as exc:
            log.warning("skipping %s: %s", f, exc)
            continue
        key = data.run_id or f.stem.removeprefix("run-")
        data.run_id = key
        groups.setdefault(key, []).append(data)
    return [merge_segments(v) for _, v in sorted(groups.items())]


def is_number(value: Any) -> bool:
    """A scalar that goes into the metrics table (bools count as 0/1; NaN and ±inf are kept)."""
    return isinstance(value, (int, float)) and not isinstance(value, complex)


def as_float(value: Any) -> float:
    return float(value) if not isinstance(value, bool) else (1.0 if value else 0.0)


__all__ = [
    "NotAWandbFileError",
    "ScanStats",
    "WandbRunData",
    "iter_record_payloads",
    "read_wandb_file",
    "find_run_files",
    "merge_segments",
    "read_offline_runs",
    "is_number",
    "as_float",
    "decode_value",
]
