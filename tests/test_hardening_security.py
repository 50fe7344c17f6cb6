"""Security: loopback by default, hostile text stored faithfully (never SQL), no code execution on imported
files, and the W&B API key never lands in the store, the logs or the page."""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from _net import free_port

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lld_monitor.store import RunNotFoundError, RunWriter, StoreError, open_store_reader  # noqa: E402

HOSTILE = [
    "'; DROP TABLE steps; --",
    '" OR 1=1 --',
    "Robert'); DROP TABLE runs;--",
    "x' UNION SELECT * FROM tokens --",
    "ünïcødé 漢字 🚀 \u202e",
    "back\\slash\\' \\\" end\\",
    "%s %d {0} {src} ?",
    "$1 :name @p",
    "line\nbreak\ttab",
]
FAKE_KEY = "f4k3" + "0123456789abcdef" * 2 + "c0ff"  # 40 characters, like a real W&B key
assert len(FAKE_KEY) == 40


def _cli(*args: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lld_monitor.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


# ----------------------------------------------------------------------------- binding
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_serve_binds_loopback_by_default_and_warns_when_wider(tmp_path):
    from lld_monitor.commands.serve import wait_ready

    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "lld_monitor.cli", "serve", "--store", str(tmp_path), "--port", str(port)],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_ready("127.0.0.1", port, timeout=90, proc=p)
        listening = []
        for proc in [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]:
            listening += [c.laddr for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        assert listening and all(a.ip == "127.0.0.1" for a in listening), listening
        assert any(a.port == port for a in listening)
    finally:
        p.terminate()
        out = p.communicate(timeout=30)[0]
    assert "anyone who can reach" not in out
    # bound wider: a warning before anything else (the server is stopped as soon as it is said)
    port2 = free_port()
    p = subprocess.Popen([sys.executable, "-m", "lld_monitor.cli", "serve", "--store", str(tmp_path), "--host", "0.0.0.0",
                          "--port", str(port2)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 60
        while "anyone who can reach" not in line and time.monotonic() < deadline:
            line = p.stdout.readline()
            assert line or p.poll() is None, "serve exited without warning"
        assert "0.0.0.0" in line and "anyone who can reach" in line, line
    finally:
        p.terminate()
        p.communicate(timeout=30)


# ----------------------------------------------------------------------------- hostile text in the store
def _samples(n: int = 4) -> dict:
    return {"reward": np.array([1.0, 0, 1, 0])[:n], "advantage": np.array([0.5, -0.5, 0.5, -0.5])[:n],
            "group_id": np.zeros(n, int), "text": [HOSTILE[i % len(HOSTILE)] for i in range(n)]}


@pytest.fixture(scope="module")
def hostile_store(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    from lld_monitor.logger import RunLogger

    store = tmp_path_factory.mktemp("hostile") / "store"
    ids = {}
    for i, name in enumerate(HOSTILE):
        if i % 2:
            with RunLogger(store, name, "vanilla", {name: name, "lr": 1e-5}, handle_signals=False) as lg:
                for s in range(3):
                    lg.log_step(s, scalars={"grad_norm": 1.0, name: float(s)}, samples=_samples(),
                                tokens={"token_id": np.ones((4, 5), int), "logp_old": np.zeros((4, 5)),
                                        "logp_new": np.zeros((4, 5))})
            ids[name] = lg.run_id
        else:
            with RunWriter.create(store, name, "llds", config={"note": name}, model=name) as w:
                w.append("steps", {"step": [0, 1, 2], "reward_mean": [0.1, 0.2, 0.3]})
                w.append("metrics", {"step": [0, 1], "key": [name, name], "value": [1.0, 2.0]})
            ids[name] = w.run_id
    return store, ids


def test_hostile_run_names_round_trip(hostile_store):
    store, ids = hostile_store
    r = open_store_reader(store)
    runs = r.runs()
    assert sorted(runs["name"]) == sorted(HOSTILE) and len(runs) == len(HOSTILE)
    for name, rid in ids.items():
        row = r.run(name)
        assert row["run_id"] == rid and row["name"] == name and row["steps"] == 3
        assert json.loads(row["config"]).get("note", json.loads(row["config"]).get(name)) == name
        assert r.sql("SELECT name FROM runs WHERE name = ?", [name])["name"].tolist() == [name]
        m = r.metrics(rid, [name])
        assert len(m) >= 2 and set(m["key"]) == {name}
    # samples' free text (the decoded responses) kept as is
    lg_rid = ids[HOSTILE[1]]
    assert set(r.samples(lg_rid)["text"]) <= set(HOSTILE)
    # every table still has all its rows: nothing was dropped by any of the strings
    assert r.sql("SELECT count(*) AS n FROM steps")["n"][0] == 3 * len(HOSTILE)
    out = _cli("runs", "--store", str(store), "--json")
    assert out.returncode == 0, out.stderr
    assert sorted(x["name"] for x in json.loads(out.stdout)["runs"]) == sorted(HOSTILE)


def test_hostile_ids_in_the_reader_api_are_refused_cleanly(hostile_store):
    store, ids = hostile_store
    r = open_store_reader(store)
    before = r.sql("SELECT count(*) AS n FROM steps")["n"][0]
    for bad in [*HOSTILE, "../../etc/passwd", "runs/../x", "*", "' OR ''='", ""]:
        if bad in ids:  # a hostile *name* is found by name, faithfully
            assert r.run(bad)["name"] == bad
        else:
            with pytest.raises(RunNotFoundError):
                r.run(bad)
        for fn in (lambda: r.steps(bad), lambda: r.samples(bad), lambda: r.tokens(bad, 0), lambda: r.metrics(bad),
                   lambda: r.alerts(bad), lambda: r.signals(bad), lambda: r.token_steps(bad)):
            with pytest.raises(RunNotFoundError):
                fn()
        rid = ids[HOSTILE[1]]
        assert r.metrics(rid, [bad]).empty or bad in ids
        assert r.sql("SELECT count(*) AS n FROM runs WHERE run_id = ? OR name = ?", [bad, bad])["n"][0] == int(bad in ids)
        with pytest.raises(StoreError, match="unknown steps column"):
            r.steps(rid, columns=[bad or "x"])
        for v in (bad, "1; DROP TABLE steps", "1 OR 1=1"):
            with pytest.raises((ValueError, TypeError)):
                r.tokens(rid, v)  # step must be an int
    assert r.sql("SELECT count(*) AS n FROM steps")["n"][0] == before


def test_detect_cli_with_hostile_run_names(hostile_store):
    store, ids = hostile_store
    args = ["detect", "--store", str(store), "--json"]
    for name in HOSTILE:
        args += ["--run", name]
    out = _cli(*args)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)["runs"]
    assert sorted(x["name"] for x in got) == sorted(HOSTILE)
    missing = _cli("detect", "--store", str(store), "--run", "'; DROP TABLE runs; --x")
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert "DROP TABLE runs; --x" in missing.stderr  # named back to the user as typed
    assert len(open_store_reader(store).runs()) == len(HOSTILE)


def test_dashboard_pages_with_hostile_inputs(hostile_store, tmp_path):
    from streamlit.testing.v1 import AppTest

    store, ids = hostile_store
    pages = ["live", "compare", "tokens", "postmortem"]

    def check(at: AppTest) -> None:
        assert not at.exception, [e.value for e in at.exception][:3]
        text = " ".join(str(e.value) for e in [*at.error, *at.warning, *at.markdown, *at.caption])
        for marker in ("Binder Error", "Parser Error", "syntax error", "Catalog Error"):
            assert marker not in text, text[:2000]

    # the sidebar's store field: hostile paths give a clear message, never a traceback
    for bad in [HOSTILE[0], HOSTILE[1], "../" * 8 + "etc", str(tmp_path / "x'; --")]:
        at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90)
        at.session_state["store_path"] = bad
        at.run()
        check(at)
        assert any("No store" in str(e.value) or "not an lld-monitor store" in str(e.value)
                   for e in [*at.error, *at.warning, *at.info, *at.markdown]), bad
    # a real store whose runs are all hostile; query params hostile too
    for page in pages:
        for run in (ids[HOSTILE[1]], HOSTILE[0], "' OR 1=1 --"):
            at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90)
            at.session_state["store_path"] = str(store)
            at.query_params["run"] = run
            at.query_params["step"] = "1; DROP TABLE steps"
            at.query_params["sample"] = "' OR 1=1 --"
            at.query_params["rank"] = "0)--"
            at.switch_page(f"pages/{dict(live='live_health', compare='compare_runs', tokens='token_inspector', postmortem='post_mortem')[page]}.py")
            at.run()
            check(at)
    assert open_store_reader(store).sql("SELECT count(*) AS n FROM steps")["n"][0] == 3 * len(HOSTILE)


# ----------------------------------------------------------------------------- source scans
SCAN = [*sorted((ROOT / "lld_monitor").rglob("*.py")), *sorted((ROOT / "pages").glob("*.py")), ROOT / "app.py"]
SQL_CALLS = {"execute", "executemany", "sql", "query", "_run_query", "project", "filter", "create_view"}
# (file, function) pairs whose formatted SQL is provably not user text, and why
SQL_ALLOW = {
    ("lld_monitor/store/reader.py", "_relation"): "column names come from schema.py / the segment's own columns; "
                                                   "types from a fixed map",
    ("lld_monitor/store/reader.py", "_run_query.go.query"): "`{src}` is replaced by a fixed 'read_parquet(?)' "
                                                                   "or '_q'; values are ? parameters",
    ("lld_monitor/store/reader.py", "steps"): "columns validated against schema.STEPS.names before use",
    ("lld_monitor/store/reader.py", "samples"): "WHERE clauses are fixed strings joined by AND; values are ? params",
    ("lld_monitor/store/reader.py", "tokens"): "WHERE clauses are fixed strings joined by AND; values are ? params",
}


USED_ALLOW: set[tuple[str, str]] = set()


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def _is_constant(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _is_constant(node.left) and _is_constant(node.right)
    return False


def _formats(node: ast.AST) -> bool:
    """An f-string, a `%`, a `.format(...)` / `.join(...)` or a `+` with a computed part anywhere in the expression."""
    for n in ast.walk(node):
        if isinstance(n, ast.JoinedStr) and any(isinstance(v, ast.FormattedValue) for v in n.values):
            return True
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) and isinstance(n.left, (ast.Constant, ast.JoinedStr)):
            return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("format", "join"):
            return True
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add) and not _is_constant(n):
            return True  # text glued to something computed
    return False


def _qualnames(tree: ast.AST) -> dict[int, str]:
    """id(node) -> qualified name of the innermost function holding it ("outer.inner")."""
    out: dict[int, str] = {}

    def visit(node: ast.AST, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{name}.{child.name}" if name else child.name)
            else:
                out[id(child)] = name or "<module>"
                visit(child, name)

    visit(tree, "")
    return out


def _sql_offenders() -> list[str]:
    bad = []
    for path in SCAN:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        funcs = _qualnames(tree)
        # variables assigned from a formatted string (e.g. sql = f"...") then passed on
        formatted_vars = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and _formats(n.value)
                          for t in n.targets if isinstance(t, ast.Name)}
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in SQL_CALLS and n.args):
                continue
            if n.func.attr == "_run_query" and len(n.args) < 3:
                continue
            arg = n.args[2] if n.func.attr == "_run_query" else n.args[0]
            if _is_constant(arg):
                continue
            if not (_formats(arg) or (isinstance(arg, ast.Name) and arg.id in formatted_vars)):
                continue
            fn = funcs.get(id(n), "<module>")
            where = (_rel(path), fn)
            short = (_rel(path), fn.split(".")[-1])
            if where in SQL_ALLOW or short in SQL_ALLOW:
                USED_ALLOW.add(where if where in SQL_ALLOW else short)
            else:
                bad.append(f"{where[0]}:{n.lineno} in {fn}(): {ast.unparse(n)[:160]}")
    return bad


def test_no_sql_is_formatted_from_user_text():
    bad = _sql_offenders()
    assert not bad, "formatted SQL outside the allow-list (use ? parameters, or allow-list with a reason):\n" + "\n".join(bad)
    # the allow-list must not go stale: each entry still matches a formatted query
    assert USED_ALLOW == set(SQL_ALLOW), set(SQL_ALLOW) - USED_ALLOW


def test_the_sql_scan_catches_a_formatted_query(tmp_path, monkeypatch):
    p = tmp_path / "lld_monitor" / "evil.py"
    p.parent.mkdir()
    p.write_text("def q(r, name):\n    return r.sql(f\"SELECT * FROM runs WHERE name = '{name}'\")\n"
                 "def q2(con, name):\n    s = 'SELECT %s' % name\n    return con.execute(s)\n")
    monkeypatch.setattr(sys.modules[__name__], "SCAN", [p])
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert len(_sql_offenders()) == 2


BANNED = {
    ("pickle", None), ("cPickle", None), ("dill", None), ("marshal", None), ("shelve", None), ("joblib", None),
}
BANNED_CALLS = {"eval", "exec", "compile", "__import__"}
BANNED_ATTRS = {("yaml", "load"), ("yaml", "unsafe_load"), ("pd", "read_pickle"), ("pandas", "read_pickle"),
                ("np", "load"), ("numpy", "load"), ("torch", "load"), ("pickle", "loads"), ("pickle", "load")}


def test_imported_files_are_read_never_executed():
    bad = []
    for path in SCAN:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for n in ast.walk(tree):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                names = [a.name.split(".")[0] for a in n.names] if isinstance(n, ast.Import) else [(n.module or "").split(".")[0]]
                bad += [f"{_rel(path)}:{n.lineno} imports {m}" for m in names if (m, None) in BANNED]
            if isinstance(n, ast.Call):
                f = n.func
                if isinstance(f, ast.Name) and f.id in BANNED_CALLS:
                    bad.append(f"{_rel(path)}:{n.lineno} calls {f.id}()")
                if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and (f.value.id, f.attr) in BANNED_ATTRS:
                    if f.attr == "load" and f.value.id == "torch" and any(
                            k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                            for k in n.keywords):
                        continue  # torch.load(weights_only=True) only unpickles tensors
                    if f.value.id in ("np", "numpy") and any(
                            k.arg == "allow_pickle" and isinstance(k.value, ast.Constant) and k.value.value is False
                            for k in n.keywords):
                        continue
                    bad.append(f"{_rel(path)}:{n.lineno} calls {f.value.id}.{f.attr}()")
    assert not bad, "\n".join(bad)


# ----------------------------------------------------------------------------- W&B: hostile keys, the API key
WANDB_SCRIPT = r"""
import json, os, sys
import wandb
hostile = json.loads(sys.argv[1])
cfg = {k: k for k in hostile}
cfg["nested"] = {"v": hostile[0], "w": [hostile[1], hostile[2]]}
run = wandb.init(project="hostile", name=hostile[2], id="hostile-run", config=cfg)
for s in range(4):
    row = {k: float(i * 10 + s) for i, k in enumerate(hostile)}
    row["actor/grad_norm"] = 1.0 + s
    run.log(row, step=s)
run.finish()
print("WROTE", flush=True)
"""


@pytest.fixture(scope="module")
def hostile_wandb(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wbhostile")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_DIR=str(root), WANDB_SILENT="true", WANDB_CONFIG_DIR=str(root / "cfg"),
               WANDB_CACHE_DIR=str(root / "cache"), WANDB_DATA_DIR=str(root / "data"), WANDB_CONSOLE="off",
               WANDB_DISABLE_GIT="true", WANDB_API_KEY=FAKE_KEY)
    keys = [k for k in HOSTILE if "\n" not in k]  # W&B itself rejects nothing here, but keys are one line
    out = subprocess.run([sys.executable, "-c", WANDB_SCRIPT, json.dumps(keys)], env=env, cwd=root, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0 and "WROTE" in out.stdout, out.stderr[-3000:]
    return root / "wandb"


def _all_bytes(folder: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file())


def test_wandb_hostile_keys_and_config_import_faithfully(hostile_wandb, tmp_path, monkeypatch, caplog):
    from lld_monitor.integrations.wandb import importer as wi

    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    store = tmp_path / "store"
    keys = [k for k in HOSTILE if "\n" not in k]
    with caplog.at_level(logging.DEBUG):
        res = wi.import_offline(store, hostile_wandb, progress=False)
    assert len(res) == 1
    r = open_store_reader(store)
    row = r.run(HOSTILE[2])
    m = r.metrics(row["run_id"])
    got = {(int(s), k): v for s, k, v in zip(m["step"], m["key"], m["value"])}
    for i, k in enumerate(keys):
        for s in range(4):
            assert got.get((s, k)) == float(i * 10 + s), (k, s)
    cfg = json.loads(row["config"])
    for k in keys:  # the values exactly; the W&B SDK itself strips '-' from the ends of config KEYS (argparse style)
        assert cfg[k.strip("-")] == k
    assert cfg["nested"] == {"v": keys[0], "w": [keys[1], keys[2]]}
    assert r.steps(row["run_id"])["grad_norm"].tolist() == [1.0, 2.0, 3.0, 4.0]
    # the key is in the environment of the import, never in what it wrote or said
    assert FAKE_KEY.encode() not in _all_bytes(store)
    assert FAKE_KEY not in caplog.text
    # the CLI path too (stdout, stderr, --json)
    out = _cli("import-wandb", "--store", str(tmp_path / "cli"), "--offline", str(hostile_wandb), "--json",
               env={**os.environ, "WANDB_API_KEY": FAKE_KEY, "LLD_MONITOR_LOG": "DEBUG"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert FAKE_KEY not in out.stdout + out.stderr
    assert FAKE_KEY.encode() not in _all_bytes(tmp_path / "cli")


PAGE_SCRIPT = r"""
import json, os, sys
from streamlit.testing.v1 import AppTest
store, folder, key = sys.argv[1], sys.argv[2], sys.argv[3]
os.environ["WANDB_API_KEY"] = key
import wandb
class _Api:
    def __init__(self, *a, api_key=None, **k):
        # a failing login whose message carries the key, as a careless SDK or proxy error might
        raise RuntimeError(f"401 Unauthorized for key {api_key or os.environ.get('WANDB_API_KEY')}")
wandb.Api = _Api

def rendered(at):
    parts = []
    for kind in ("markdown", "error", "warning", "success", "info", "caption", "exception", "code", "text", "title"):
        parts += [str(getattr(e, "value", "")) for e in getattr(at, kind)]
    for df in at.dataframe:
        parts.append(df.value.to_csv())
    return "\n".join(parts)

at = AppTest.from_file("pages/import_wandb.py", default_timeout=90)
at.session_state["store_path"] = store
at.run()
at.text_input(key="imp_off_path").input(folder)
at.button[0].click()
at.run()
assert not at.exception, at.exception
assert any("Imported 1 run(s)" in s.value for s in at.success), [s.value for s in at.success]
page1 = rendered(at)
# the online form with the key typed in (and in the environment): the failure is shown, the key is not
at.text_input(key="imp_on_entity").input("team'; DROP TABLE runs; --")
at.text_input(key="imp_on_project").input('" OR 1=1 --')
at.text_input(key="imp_on_key").input(key)
at.button[1].click()
at.run()
assert not at.exception, at.exception
page2 = rendered(at)
assert at.error, "the failed login should be reported"
state = json.dumps({k: str(at.session_state[k]) for k in at.session_state}, default=str) if hasattr(at.session_state, "__iter__") else ""
print("PAGE1-HAS-KEY" if key in page1 else "PAGE1-CLEAN")
print("PAGE2-HAS-KEY" if key in page2 else "PAGE2-CLEAN")
print("ERRORS:", [e.value for e in at.error])
"""


def test_wandb_key_never_on_the_import_page(hostile_wandb, tmp_path):
    store = tmp_path / "store"
    out = subprocess.run([sys.executable, "-c", PAGE_SCRIPT, str(store), str(hostile_wandb), FAKE_KEY], cwd=ROOT,
                         capture_output=True, text=True, timeout=240,
                         env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "PAGE1-CLEAN" in out.stdout and "PAGE2-CLEAN" in out.stdout, out.stdout[-3000:]
    assert FAKE_KEY not in out.stdout.split("ERRORS:")[-1]
    assert FAKE_KEY not in out.stderr, "the key was logged while the page ran"
    assert FAKE_KEY.encode() not in _all_bytes(store)
    with open_store_reader(store) as r:
        assert r.runs()["name"].tolist() == [HOSTILE[2]]
