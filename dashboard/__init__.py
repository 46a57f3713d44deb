"""The trainhealth dashboard: a Streamlit app that only reads Redis.

``dashboard/app.py`` is the entry point (``streamlit run dashboard/app.py``); every Redis read
lives in :mod:`trainhealth.dashboard.data` (no Streamlit import there, so it is unit-testable) and every
Plotly figure in :mod:`trainhealth.dashboard.charts`.
"""
