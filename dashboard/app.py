"""trainhealth dashboard entry point: ``streamlit run dashboard/app.py``.

Frames every page (see :mod:`trainhealth.dashboard.frame`): page navigation, the login gate and the
read-only note (docs/security.md), the Redis connection and the run picker in the sidebar. The selected
run lives in ``st.session_state`` (shared by all pages) and is mirrored in ``?run=<id>`` so a link opens
that run. Nothing here writes to Redis.
"""

from __future__ import annotations

from trainhealth.dashboard import frame

frame.page_config()
page = frame.navigation()
if frame.sidebar():
    frame.run_page(page)
