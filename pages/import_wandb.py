"""Import from W&B: pull runs into the current store (offline wandb/ folders, or online through the W&B API).

Thin page: the work is lld_monitor.integrations.wandb.importer (no torch on this path). The API key field is
optional (default: WANDB_API_KEY / ~/.netrc / `wandb login`); its value goes to wandb.Api only, the form
is cleared on submit, and nothing stores or prints it.
"""

from pathlib import Path

import streamlit as st

from lld_monitor.integrations.wandb import importer as wi
from lld_monitor.store.schema import MODES
from lld_monitor.ui import widgets

ctx = widgets.current()
st.title("Import from W&B")
st.caption(
    f"Into the store `{ctx.store}` (change it in the sidebar). Every scalar key is kept; verl / Search-R1 and "
    "TRL names are mapped onto the step signals; importing a run again replaces it."
)
if Path(ctx.store).resolve() == (Path(__file__).resolve().parents[1] / "sample_runs").resolve():
    st.warning("The current store is the bundled `sample_runs/`. Imports would be added to it: type another "
               "store folder in the sidebar (e.g. `lld_runs`) to keep the samples as shipped.")
MODE_CHOICES = ["infer from config", *MODES]


def _mode(choice: str) -> str | None:
    return None if choice == MODE_CHOICES[0] else choice


def _show(results, missing=(), failed=None) -> None:
    if results:
        st.success(f"Imported {len(results)} run(s) into `{ctx.store}`. Pick them in the sidebar.")
        st.dataframe(wi.results_frame(results), hide_index=True, key="imp_results")
        for r in results:
            for p in r.problems:
                st.warning(f"{r.name}: {p}")
        st.cache_data.clear()  # the runs list and per-run caches must see the new runs
    for rid in missing:
        st.warning(f"`{rid}` was not found on W&B (deleted, or a wrong id); skipped.")
    for rid, err in (failed or {}).items():
        st.error(f"`{rid}` failed: {err}")


off, on = st.tabs(["Offline folder", "Online (W&B API)"])
with off:
    with st.form("imp_offline"):
        path = st.text_input("Folder", placeholder="path/to/wandb  (or an offline-run-* folder, or a .wandb file)",
                             key="imp_off_path")
        mode = st.selectbox("Mode", MODE_CHOICES, key="imp_off_mode")
        go = st.form_submit_button("Import", type="primary")
    if go:
        if not path.strip():
            st.error("Type the path of a wandb/ folder, an offline-run-* folder or a .wandb file.")
        else:
            try:
                with st.spinner("Reading .wandb files..."):
                    res = wi.import_offline(ctx.store, path.strip(), mode=_mode(mode), progress=False)
                _show(res)
            except (wi.ImportError_, FileNotFoundError, ValueError) as exc:
                st.error(str(exc))
            except Exception as exc:  # noqa: BLE001 - say what happened; nothing already stored is touched
                st.error(f"Import failed ({type(exc).__name__}): {exc}")

with on:
    with st.form("imp_online", clear_on_submit=True):
        c1, c2 = st.columns(2)
        entity = c1.text_input("Entity", key="imp_on_entity")
        project = c2.text_input("Project", key="imp_on_project")
        ids = st.text_input("Run ids (comma separated; empty = every run of the project)", key="imp_on_ids")
        key = st.text_input("API key (optional)", type="password", key="imp_on_key",
                            help="Leave empty to use WANDB_API_KEY, ~/.netrc or `wandb login`. Never stored.")
        mode_on = st.selectbox("Mode", MODE_CHOICES, key="imp_on_mode")
        go_on = st.form_submit_button("Import", type="primary")
    if go_on:
        if not (entity.strip() and project.strip()):
            st.error("Entity and project are both needed.")
        else:
            run_ids = [x.strip() for x in ids.split(",") if x.strip()] or None
            try:
                with st.spinner("Fetching from W&B..."):
                    rep = wi.import_online(ctx.store, entity.strip(), project.strip(), run_ids,
                                           api_key=key or None, mode=_mode(mode_on), progress=False)
                _show(rep.imported, rep.missing, rep.failed)
            except wi.ImportError_ as exc:
                st.error(str(exc))
            except Exception as exc:  # noqa: BLE001
                st.error(f"Import failed ({type(exc).__name__}). Check the entity, project and network.")
            finally:
                key = None
