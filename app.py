"""lld-monitor dashboard (Streamlit entry point): `lld-monitor serve` or `streamlit run app.py`.

Navigation over the page files in pages/; the sidebar (store location + run picker) is drawn here, once
per script run, so every page has it. Pages are thin: data from lld_monitor.ui.queries (through the
cached wrappers in lld_monitor.ui.widgets), figures from lld_monitor.ui.figures.
"""

from pathlib import Path

import streamlit as st

from lld_monitor.ui import widgets

HERE = Path(__file__).resolve().parent
PAGES = HERE / "pages"

st.set_page_config(page_title="lld-monitor", page_icon=":material/trending_down:", layout="wide")

LIVE = st.Page(str(PAGES / "live_health.py"), title="Live health", icon=":material/monitor_heart:", url_path="live")


def _home() -> None:
    """The root URL opens Live health at its own address (/live), query parameters (?run=) kept."""
    st.switch_page(LIVE, query_params=st.query_params.to_dict())


# the default page of st.navigation is served at "/" only; Live health lives at /live so that bookmarked and
# shared /live links open (a hidden default page redirects "/" there)
pages = [
    st.Page(_home, title="Live health", url_path="home", default=True, visibility="hidden"),
    LIVE,
    st.Page(str(PAGES / "compare_runs.py"), title="Compare runs", icon=":material/compare_arrows:", url_path="compare"),
    st.Page(str(PAGES / "token_inspector.py"), title="Token inspector", icon=":material/text_fields:", url_path="tokens"),
    st.Page(str(PAGES / "post_mortem.py"), title="Post-mortem", icon=":material/troubleshoot:", url_path="postmortem"),
    st.Page(str(PAGES / "import_wandb.py"), title="Import from W&B", icon=":material/download:", url_path="import-wandb"),
]

nav = st.navigation(pages)
widgets.sidebar()
nav.run()
