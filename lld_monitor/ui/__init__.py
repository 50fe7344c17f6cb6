"""Dashboard building blocks.

Everything here except `widgets` is pure: functions from DataFrames (or a StoreReader) to DataFrames,
Plotly figures or HTML strings, so tests call them without Streamlit. `widgets` holds the Streamlit
pieces the pages share (sidebar, cached reader access, empty states). Nothing here imports torch.
"""
