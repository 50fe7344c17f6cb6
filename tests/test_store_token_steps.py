"""The token-logged step list comes from the manifests' per-segment `steps` (issue 30: the post-mortem listed them
with a DISTINCT over every token row) and is always what that DISTINCT gives, on new stores, on stores written
before segment entries had `steps`, and on a mix of both."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from lld_monitor.store import RunWriter, WriterConfig, layout, open_store_reader, stepset


@pytest.mark.parametrize("steps, runs", [
    ([], []),
    ([5], [[5, 5, 1]]),
    ([3, 1, 2], [[1, 3, 1]]),
    ([0, 10, 20, 21, 22], [[0, 20, 10], [21, 22, 1]]),
    ([0, 2000, 4000, 6000, 7], [[0, 7, 7], [2000, 6000, 2000]]),
    ([4, 4, 9], [[4, 9, 5]]),
    ([1, 2, 4, 8], [[1, 2, 1], [4, 8, 4]]),
])
def test_compress_hand_cases(steps, runs):
    assert stepset.compress(steps) == runs
    assert stepset.expand(runs) == sorted(set(steps))


def test_expand_inverts_compress_on_random_sets():
    rng = random.Random(0)
    for _ in range(500):
        kind = rng.choice(["every", "sparse", "mixed"])
        if kind == "every":
            k = rng.randint(1, 50)
            s = list(range(rng.randint(0, 30), rng.randint(0, 5000), k))
        elif kind == "sparse":
            s = rng.sample(range(10_000), rng.randint(0, 60))
        else:
            s = list(range(0, 300, 7)) + rng.sample(range(300, 900), 20)
        assert stepset.expand(stepset.compress(s)) == sorted(set(s))
        assert len(stepset.compress(s)) <= max(1, len(set(s)))


def test_expand_refuses_a_bad_run():
    with pytest.raises(ValueError, match="stride > 0"):
        stepset.expand([[10, 5, 1]])
    with pytest.raises(ValueError, match="stride > 0"):
        stepset.expand([[0, 5, 0]])


def _tokens(step: int, n_samples: int = 2, n_tok: int = 3) -> dict:
    n = n_samples * n_tok
    return {"step": np.full(n, step), "sample_idx": np.repeat(np.arange(n_samples), n_tok),
            "position": np.tile(np.arange(n_tok), n_samples), "token_id": np.arange(n), "role": ["action"] * n,
            "action_idx": np.zeros(n), "logp_old": np.full(n, -1.0), "logp_new": np.full(n, -1.1),
            "entropy": np.full(n, 0.5)}


def _distinct(r, run_id: str) -> list[int]:
    df = r.sql("SELECT DISTINCT step FROM tokens WHERE run_id = ? ORDER BY step", [run_id])
    return [int(s) for s in df["step"]]


def _write(tmp_path, steps_by_rank: dict[int, list[int]], finish: bool = True) -> list[RunWriter]:
    cfg = WriterConfig(compact_fanout=2, retire_grace_s=0.0, background_compaction=False)
    w0 = RunWriter.create(tmp_path, "t", "vanilla", run_id="t", world_size=len(steps_by_rank), writer_config=cfg)
    writers = [w0] + [RunWriter.create(tmp_path, "t", "vanilla", run_id="t", rank=k, world_size=len(steps_by_rank),
                                       writer_config=cfg) for k in sorted(steps_by_rank) if k]
    for w in writers:
        for i, s in enumerate(steps_by_rank[w.rank]):
            w.append("tokens", _tokens(s))
            if i % 3 == 2:
                w.flush()
    for w in writers:
        w.flush()
        if finish:
            w.finish()
    return writers


PATTERNS = {
    "every 10th": {0: list(range(0, 400, 10))},
    "irregular": {0: [0, 1, 2, 3, 50, 51, 99, 100, 250, 251, 252, 900]},
    "two ranks": {0: list(range(0, 60, 5)), 1: list(range(0, 60, 5)) + [61, 63]},
}


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("finish", [False, True])
def test_token_steps_equal_distinct_from_manifests_alone(tmp_path, monkeypatch, pattern, finish):
    _write(tmp_path, PATTERNS[pattern], finish=finish)
    want = sorted({s for steps in PATTERNS[pattern].values() for s in steps})
    for mpath in (tmp_path / layout.RUNS_DIR / "t").glob("manifest-r*.json"):
        entries = json.loads(mpath.read_text())["segments"]["tokens"]
        assert entries and all("steps" in e for e in entries)  # merged segments too
    with open_store_reader(tmp_path) as r:
        assert _distinct(r, "t") == want

    with open_store_reader(tmp_path) as r:
        class NoDuckDB:
            def __getattr__(self, name):
                raise AssertionError("token_steps queried Parquet although every segment lists its steps")

        real = r._con
        monkeypatch.setattr(r, "_con", NoDuckDB())
        assert r.token_steps("t") == want
        monkeypatch.setattr(r, "_con", real)


@pytest.mark.parametrize("strip", ["all", "every other"])
def test_stores_written_before_entries_had_steps_read_the_same(tmp_path, strip):
    _write(tmp_path, PATTERNS["two ranks"], finish=False)
    want = sorted({s for steps in PATTERNS["two ranks"].values() for s in steps})
    for mpath in (tmp_path / layout.RUNS_DIR / "t").glob("manifest-r*.json"):
        man = json.loads(mpath.read_text())
        for i, e in enumerate(man["segments"]["tokens"]):
            if strip == "all" or i % 2:
                e.pop("steps")
        mpath.write_text(json.dumps(man))
    with open_store_reader(tmp_path) as r:
        assert r.token_steps("t") == want == _distinct(r, "t")


def test_a_resumed_writer_merges_old_segments_into_listed_ones(tmp_path):
    (w,) = _write(tmp_path, {0: [0, 1, 2, 3, 4]}, finish=False)
    mpath = layout.manifest_path(tmp_path, "t", 0)
    man = json.loads(mpath.read_text())
    for e in man["segments"]["tokens"]:
        e.pop("steps")
    w._manifest = man  # as if these segments came from an older writer
    w.append("tokens", _tokens(7))
    w.finish()
    entries = json.loads(mpath.read_text())["segments"]["tokens"]
    assert len(entries) == 1 and stepset.expand(entries[0]["steps"]) == [0, 1, 2, 3, 4, 7]


def test_live_run_lists_new_token_steps_after_each_flush(tmp_path):
    w = RunWriter.create(tmp_path, "live", "vanilla", run_id="live")
    r = open_store_reader(tmp_path)
    seen = []
    for s in range(0, 12, 3):
        w.append("tokens", _tokens(s))
        w.flush()
        seen.append(r.token_steps("live"))
    w.finish()
    assert seen == [[0], [0, 3], [0, 3, 6], [0, 3, 6, 9]]
    assert r.token_steps("live") == [0, 3, 6, 9] == _distinct(r, "live")
    r.close()
