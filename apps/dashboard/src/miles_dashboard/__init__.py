"""miles_dashboard: the Miles web dashboard, a Streamlit app over the REST API.

It reaches the control plane only through miles-control's typed API client and schema models (httpx and
pydantic; no torch, no Ray), so it deploys on its own: `pip install miles-dashboard`, then `miles-dashboard
--api URL`. The pages are scripts that Streamlit runs (`app.py`, `views/*.py`); `APP` is the entry page.
"""

from pathlib import Path

APP = Path(__file__).with_name("app.py")
"""The Streamlit entry page (navigation), what `streamlit run` and `AppTest.from_file` take."""
