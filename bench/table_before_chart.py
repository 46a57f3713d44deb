"""What a table before a chart costs the chart, in headless Chromium: ``st.dataframe`` vs a markdown table.

Run: ``.venv/bin/python bench/table_before_chart.py [--loads 7]`` (about 2 minutes).

Three Streamlit pages, each served by its own ``streamlit run`` (``bench/dashboard_scale.py``'s harness), each
ending with the same Plotly line of 2,000 points:

- ``chart only``: a markdown line, then the chart (the baseline, measured in the same run);
- ``dataframe first``: a collapsed expander holding a 3-row ``st.dataframe``, then the chart;
- ``markdown first``: the same expander holding the same rows as a markdown table
  (:func:`trainhealth.dashboard.common.markdown_table`), then the chart.

Each page is loaded ``--loads`` times after one warm-up load, in turn, each in a fresh browser context; printed is
the median ms from navigation start to the first drawn ``.js-plotly-plot .main-svg`` (a MutationObserver), each
beside the chart-only page's. Why: the dashboard's "Other incidents" table and Goodput's rates table were data
grids before the page's first chart (issue 16; BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import dashboard_scale as ds

HEAD = "import numpy as np, pandas as pd, plotly.graph_objects as go, streamlit as st\nst.markdown('**state** line')\n"
CHART = "x = np.arange(2000)\nst.plotly_chart(go.Figure(go.Scatter(x=x, y=np.sin(x / 50))), key='c')\n"
#: The pages read nothing: a URL no server answers, so none is started.
NO_REDIS = "redis://127.0.0.1:1/0"
PAGES = {
    "chart only": HEAD + CHART,
    "dataframe first": HEAD + "with st.expander('Other incidents (3)'):\n"
                              "    st.dataframe(pd.DataFrame({'a': [1, 2, 3], 'b': ['x', 'y', 'z']}),\n"
                              "                 hide_index=True)\n" + CHART,
    "markdown first": HEAD + "from trainhealth.dashboard.common import markdown_table\n"
                             "with st.expander('Other incidents (3)'):\n"
                             "    st.markdown(markdown_table(['a', 'b'], [[1, 'x'], [2, 'y'], [3, 'z']]))\n" + CHART,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loads", type=int, default=7, help="measured loads of each page (medians)")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    tmp = Path(tempfile.mkdtemp(prefix="th-table-chart-"))
    scripts = {}
    for name, text in PAGES.items():
        scripts[name] = tmp / (name.replace(" ", "_") + ".py")
        scripts[name].write_text(text)
    with sync_playwright() as pw, contextlib.ExitStack() as stack:
        bases = {name: stack.enter_context(ds.streamlit_server(path, NO_REDIS, tmp / f"{path.stem}.log"))[0]
                 for name, path in scripts.items()}
        browser = pw.chromium.launch(executable_path=ds.CHROMIUM, args=ds.CHROMIUM_ARGS)
        try:
            for base in bases.values():
                ds.open_page(browser, base, ds.SELECTORS["chart"])  # warm-up
            drawn: dict[str, list[float]] = {name: [] for name in bases}
            for _ in range(args.loads):
                for name, base in bases.items():
                    drawn[name].append(ds.open_page(browser, base, ds.SELECTORS["chart"])["first_ms"])
        finally:
            browser.close()
    ref = statistics.median(drawn["chart only"])
    print(f"first chart drawn, median of {args.loads} fresh loads (ms); x the chart-only page in the same run")
    for name, values in drawn.items():
        med = statistics.median(values)
        print(f"  {name:<16} {med:>7,.0f} ms  x{med / ref:.2f}   {[round(v) for v in values]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
