"""The dashboard in a real browser (Playwright driving Debian's Chromium) against a real API that runs
real jobs: launch from the UI, watch it succeed, open its timeline, tune a running job.

Screenshots go to artifacts/screenshots/ (ignored by git)."""

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from miles_control.service.store import Store
from miles_control.service.store.tokens import create_token
from miles_control.testing.servers import ApiServer, free_port, stop_local_ray, wait_until_serving

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "artifacts" / "screenshots"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
pytestmark = [
    pytest.mark.slow,
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (scripts/browser.sh installs it)"),
]


@pytest.fixture
def stack(tmp_path):
    """A store, an API server that launches real jobs, and the dashboard, all on loopback."""
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    url = f"sqlite:///{tmp_path}/miles.db"
    store = Store(url)
    _, token = create_token(store, "browser", "admin")
    api = ApiServer(url, tmp_path, poll_interval_s="0.3", cpus="2", presets_dir=str(ROOT / "examples")).start()
    port = free_port()
    log = open(tmp_path / "dashboard.log", "ab")
    ui = subprocess.Popen(  # the app's own entry point (the `miles-dashboard` command)
        [sys.executable, "-m", "miles_dashboard", "--api", api.url, "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    wait_until_serving(f"{base}/_stcore/health", ui, log=tmp_path / "dashboard.log")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.set_default_timeout(60_000)
        try:
            yield {"page": page, "base": base, "api": api, "token": token, "store": store}
        finally:
            browser.close()
            ui.terminate()
            ui.wait(timeout=20)
            api.stop()
            stop_local_ray(tmp_path)


def shot(page, name: str) -> None:
    page.screenshot(path=str(SHOTS / f"{name}.png"))  # what a 1280×800 window shows


def wait_text(page, pattern: str, timeout_s: float = 240) -> None:
    """Wait for visible text matching `pattern`, in short waits: on a page that redraws every few seconds under
    load, one long `wait_for` was seen to miss a header that a fresh look found at once. A screenshot on timeout
    (artifacts/screenshots/timeout.png) shows what the page showed instead."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    text = page.get_by_text(re.compile(pattern))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            text.first.wait_for(timeout=5_000)
            return
        except PlaywrightTimeout:
            if time.monotonic() > deadline:
                shot(page, "timeout")
                raise


def sign_in(page, token: str) -> None:
    """What every visitor does: the dashboard holds no token of its own. The sign-in lasts the browser session."""
    page.get_by_label("Token").fill(token)
    page.get_by_role("button", name="Connect").click()
    page.get_by_label("Token").wait_for(state="detached")
    # The cookie that keeps the sign-in is written by the page's script a moment after the redraw: a navigation
    # before it lands would find no sign-in (the page asks again), so wait for it as a visitor's next click would.
    deadline = time.monotonic() + 30
    while not any(c["name"] == "miles_session" for c in page.context.cookies()):
        assert time.monotonic() < deadline, "the sign-in cookie was never written"
        time.sleep(0.1)


def test_launch_watch_timeline_and_tune_in_a_browser(stack):
    from playwright.sync_api import expect

    page, base = stack["page"], stack["base"]
    page.goto(base)
    wait_text(page, "Sign in with your token")
    sign_in(page, stack["token"])
    wait_text(page, "^Jobs$")
    wait_text(page, "No jobs yet")
    shot(page, "1-jobs-empty")
    spec = page.get_by_label("Job spec (YAML)")
    # the default preset; the page may still be filling the form when its first elements show
    expect(spec).to_have_value(re.compile("name: arithmetic-quick"), timeout=60_000)
    # A typo, validated: the API's error under the editor, and in the editor's own gutter the line numbers with the
    # refused line shaded (the gutter is the text area's background, scrolling with its text)
    preset = spec.input_value()
    spec.fill(preset.replace("schedule:\n", "schedule:\n  max_stalenes: 2\n", 1))
    page.get_by_role("button", name="Validate").click()
    wait_text(page, "did you mean 'max_staleness'")
    # The gutter's <style> is an element of its own, re-rendered after the error on each rerun: wait for it.
    computed = (
        "t => { const c = getComputedStyle(t); return [c.paddingLeft, c.whiteSpace, c.backgroundAttachment, "
        "c.backgroundImage.slice(0, 30)]; }"
    )
    expected = ["44px", "pre", "local", 'url("data:image/svg+xml;base64']
    deadline = time.monotonic() + 30
    while (style := spec.evaluate(computed)) != expected and time.monotonic() < deadline:
        time.sleep(0.25)
    assert style == expected, style
    spec.scroll_into_view_if_needed()
    shot(page, "1b-launch-refused")
    spec.fill(preset)
    page.get_by_role("button", name="Launch").click()
    wait_text(page, r"#1 arithmetic-quick")  # launching goes straight to the new job's page
    shot(page, "2-job-launched")
    wait_text(page, "succeeded")  # the page refreshes itself while the job is active
    wait_text(page, "step 10/10")
    shot(page, "3-job-metrics")
    # A click in a metric panel picks the nearest point: that step's samples and timeline open under the charts.
    chart = page.locator('[data-testid="stVegaLiteChart"]:visible').first  # the metric grid (other tabs are hidden)
    chart.scroll_into_view_if_needed()
    box = chart.bounding_box()
    page.mouse.click(box["x"] + box["width"] * 0.25, box["y"] + min(box["height"] * 0.3, 200))  # in the first panel
    wait_text(page, r"^Step \d+$", timeout_s=60)
    page.get_by_text(re.compile(r"^Step \d+$")).first.scroll_into_view_if_needed()
    shot(page, "3b-step-detail")
    page.get_by_role("tab", name="Timeline").click()
    spans = page.get_by_text(re.compile("^Spans shown:")).first
    spans.wait_for()
    shown = spans.inner_text()
    for stage in ("rollout", "reward", "train", "weight_sync"):
        assert stage in shown, shown
    shot(page, "4-job-timeline")
    page.get_by_role("tab", name="Time breakdown").click()
    wait_text(page, "Wall time")
    shot(page, "5-job-breakdown")

    # A running job: tune it from the Tune page and see the change recorded.
    spec_data = yaml.safe_load((ROOT / "examples" / "quick.yaml").read_text())
    spec_data.update(name="tune-me")
    spec_data["schedule"].update(type="one_step_off", num_steps=200, checkpoint_every=0)  # a schedule with an interval
    headers = {"Authorization": f"Bearer {stack['token']}"}
    created = httpx.post(f"{stack['api'].url}/api/v1/jobs", json={"spec": spec_data}, headers=headers).json()
    deadline = time.time() + 180
    while httpx.get(f"{stack['api'].url}/api/v1/jobs/{created['id']}", headers=headers).json()["status"] != "running":
        assert time.time() < deadline
        time.sleep(0.5)
    page.get_by_role("link", name="Tune").click()  # in-app navigation keeps the signed-in session
    wait_text(page, "tune-me")
    field = page.get_by_label("update_weights_interval")
    field.fill("3")
    field.press("Tab")
    page.get_by_role("button", name="Review change").click()
    wait_text(page, "update_weights_interval")
    page.get_by_role("button", name="Confirm").click()
    wait_text(page, "it applies at the job's next step")
    for _ in range(60):  # the change applies at the job's next step; the page shows it once reloaded
        page.reload()  # a new Streamlit session, still signed in (the browser session's cookie)
        wait_text(page, "tune-me")
        if page.get_by_text(re.compile(r"applied.*before step \d+")).count():
            break
        time.sleep(1)
    wait_text(page, r"update_weights_interval = 3.*applied", timeout_s=5)
    shot(page, "6-tune-applied")
    [change] = stack["store"].schedule_changes(created["id"])
    assert change.status == "applied" and change.patch == {"update_weights_interval": 3}
    httpx.post(f"{stack['api'].url}/api/v1/jobs/{created['id']}/cancel", headers=headers)

    page.get_by_role("link", name="Compare").click()
    wait_text(page, "Compare runs")
    shot(page, "7-compare")
    diff = page.get_by_text("Config diff").first  # the two runs differ in their schedule only: no warning
    diff.wait_for()
    diff.scroll_into_view_if_needed()
    assert not page.get_by_text("differ in more than the schedule").count()
    shot(page, "7b-compare-config-diff")


@pytest.mark.extended  # the banner and its going are in test_every_page_says_the_api_is_down_...; this adds the list
def test_pages_refresh_by_themselves_and_ride_out_an_api_outage(stack):
    """The jobs list shows a job created elsewhere without any input; when the API stops the page keeps its data
    under a "disconnected — retrying" banner, and the banner goes once the API is back."""
    page, api = stack["page"], stack["api"]
    page.goto(stack["base"])
    sign_in(page, stack["token"])
    wait_text(page, "No jobs yet")
    spec_data = yaml.safe_load((ROOT / "examples" / "quick.yaml").read_text())
    spec_data.update(name="made-elsewhere")
    headers = {"Authorization": f"Bearer {stack['token']}"}
    created = httpx.post(f"{api.url}/api/v1/jobs", json={"spec": spec_data}, headers=headers).json()
    # no click, no reload: the list refreshed itself (the table is a canvas; its caption is text)
    wait_text(page, r"^1 job\(s\)", timeout_s=60)
    httpx.post(f"{api.url}/api/v1/jobs/{created['id']}/cancel", headers=headers)
    wait_text(page, r"1 job\(s\); 0 active", timeout_s=120)

    api.stop()
    wait_text(page, "Disconnected — retrying", timeout_s=60)
    # the page keeps the data it last showed
    assert page.get_by_text(re.compile(r"1 job\(s\); 0 active")).count(), page.inner_text("body")[:2000]
    assert not page.get_by_text(re.compile("Cannot use the Miles API")).count()
    shot(page, "8-disconnected")
    api.start()
    page.get_by_text(re.compile("Disconnected — retrying")).first.wait_for(state="detached", timeout=60_000)
    wait_text(page, r"1 job\(s\); 0 active", timeout_s=30)
    shot(page, "9-reconnected")


# ---- the third version: every page fits the screen, follows the job, rides out the API, keeps the sign-in --------
sys.path.insert(0, str(Path(__file__).parent))
from test_dashboard import seed_run  # noqa: E402

from miles_control.job.status import JobStatus  # noqa: E402

SIZES = {"wide": {"width": 1280, "height": 800}, "narrow": {"width": 390, "height": 844}}
PAGES = {"jobs": ("", "^Jobs$"), "job": ("job?job={job}", r"^#\d+ "), "tune": ("tune", "^Tune a running job$"),
         "compare": ("compare", "^Compare runs$"), "reports": ("reports", "^Bench reports$")}  # fmt: skip
OVERFLOW = """() => {
  const problems = [];
  const doc = document.documentElement;
  if (doc.scrollWidth > doc.clientWidth + 1) problems.push(`the page scrolls sideways: ${doc.scrollWidth} > ${doc.clientWidth}`);
  const main = document.querySelector('[data-testid="stMainBlockContainer"]') || document.body;
  const box = main.getBoundingClientRect();
  for (const el of document.querySelectorAll('[data-testid="stVegaLiteChart"], [data-testid="stDataFrame"], [data-testid="stTable"]')) {
    if (!el.offsetParent) continue;  // in a hidden tab
    const r = el.getBoundingClientRect();
    const name = el.getAttribute('data-testid');
    if (r.left < box.left - 1 || r.right > box.right + 1) problems.push(`${name} spans ${r.left}-${r.right}, the page ${box.left}-${box.right}`);
    for (const inner of el.querySelectorAll('canvas.marks, svg.marks')) {
      const w = inner.getBoundingClientRect().width;
      if (w > r.width + 2) problems.push(`${name}: its drawing is ${w} px wide in ${r.width}`);
    }
  }
  return problems;
}"""


def no_traceback(page) -> None:
    assert not page.locator('[data-testid="stException"]').count(), page.inner_text("body")[:3000]
    assert "Traceback (most recent call last)" not in page.inner_text("body")


def seeded(store) -> dict:
    """Two finished runs with metrics, spans and samples, straight in the store the API reads."""
    return {"done": seed_run(store, "wide-run", "sync", 5, JobStatus.SUCCEEDED),
            "other": seed_run(store, "other-run", "fully_async", 5, JobStatus.CANCELLED)}  # fmt: skip


def test_every_page_fits_a_wide_and_a_narrow_screen(stack):
    """At 1,280 × 800 and at 390 × 844 no chart or table overflows its container, the page never scrolls sideways,
    the sign-in form is in view, and each page's primary action is reachable."""
    jobs = seeded(stack["store"])
    browser = stack["page"].context.browser
    for size, viewport in SIZES.items():
        context = browser.new_context(viewport=viewport)
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(stack["base"])
        form = page.get_by_label("Token")
        form.wait_for()
        box = form.bounding_box()
        assert box and box["x"] >= 0 and box["x"] + box["width"] <= viewport["width"], box  # not in a hidden sidebar
        sign_in(page, stack["token"])
        for name, (path, title) in PAGES.items():
            page.goto(f"{stack['base']}/{path.format(job=jobs['done'])}")
            wait_text(page, title, timeout_s=60)
            if name == "job":
                page.locator('[data-testid="stVegaLiteChart"]').first.wait_for()
            if name == "compare":
                wait_text(page, "Time breakdown", timeout_s=60)
            time.sleep(1.5)  # charts size themselves to their container after the first draw
            problems = page.evaluate(OVERFLOW)
            assert not problems, f"{size} {name}: {problems}"
            no_traceback(page)
            page.screenshot(path=str(SHOTS / f"{size}-{name}.png"), full_page=size == "narrow")
            if name == "jobs":  # the primary action, in reach
                launch = page.get_by_role("button", name="Launch")
                launch.scroll_into_view_if_needed()
                box = launch.bounding_box()
                assert box and box["x"] + box["width"] <= viewport["width"], box
            if name == "job":
                assert not page.get_by_role("button", name="Resume").count()  # a succeeded job: nothing to resume
                page.get_by_role("tab", name="Samples").click()
                wait_text(page, r"sample\(s\) of this step stored")
                page.goto(f"{stack['base']}/job?job={jobs['other']}")  # a cancelled one: Resume, in reach
                resume = page.get_by_role("button", name="Resume")
                resume.wait_for()
                resume.scroll_into_view_if_needed()
                box = resume.bounding_box()
                assert box and 0 <= box["x"] and box["x"] + box["width"] <= viewport["width"], box
        context.close()


def test_every_page_says_the_api_is_down_and_never_shows_a_traceback(stack):
    """With the API stopped, every page (opened in the app, and opened by its address in a new session) shows the
    one banner and no traceback."""
    page, api = stack["page"], stack["api"]
    jobs = seeded(stack["store"])
    page.goto(stack["base"])
    sign_in(page, stack["token"])
    wait_text(page, r"job\(s\)")
    api.stop()
    try:
        wait_text(page, "Disconnected — retrying", timeout_s=60)
        for name, (path, _) in PAGES.items():
            page.goto(f"{stack['base']}/{path.format(job=jobs['done'])}")  # a new session: nothing remembered
            wait_text(page, "Disconnected — retrying", timeout_s=60)
            time.sleep(1)
            no_traceback(page)
            if name == "compare":
                shot(page, "8b-compare-disconnected")
    finally:
        api.start()
    page.get_by_text(re.compile("Disconnected — retrying")).first.wait_for(state="detached", timeout=60_000)
    no_traceback(page)


def test_a_reload_a_new_tab_and_a_direct_link_stay_signed_in(stack):
    context = stack["page"].context.browser.new_context(viewport=SIZES["wide"])  # one browser session, two tabs
    page = context.new_page()
    page.set_default_timeout(60_000)
    jobs = seeded(stack["store"])
    page.goto(stack["base"])
    sign_in(page, stack["token"])
    wait_text(page, "^Jobs$")
    page.reload()
    wait_text(page, "^Jobs$")
    assert not page.get_by_label("Token").count()
    tab = page.context.new_page()  # a new tab, straight to a job
    tab.goto(f"{stack['base']}/job?job={jobs['other']}")
    wait_text(tab, f"#{jobs['other']} other-run", timeout_s=60)
    assert "miles_" not in tab.url  # the token never travels in an address
    tab.get_by_text("Connection").first.click()
    tab.get_by_role("button", name="Sign out").click()
    tab.get_by_label("Token").wait_for()
    tab.reload()
    tab.get_by_label("Token").wait_for()  # signed out: the cookie is gone too
    context.close()


def test_the_job_page_follows_a_cancel_and_a_resume_to_the_end(stack):
    """Cancel (confirmed) and Resume from the page; the page follows the job to succeeded with no reload, and the
    time it ran counts both attempts."""
    page = stack["page"]
    spec = yaml.safe_load((ROOT / "examples" / "quick.yaml").read_text())
    spec.update(name="follow-me")
    # Steps of about 4 s here (256 prompts): the cancel must land before the job ends by itself (16-prompt steps
    # of 0.3 s let a fast machine finish the job between the click and the cancel), with a checkpoint at each step.
    spec["rollout"]["num_prompts_per_step"] = 256
    spec["rollout"]["eval"]["every_steps"] = 100
    spec["schedule"].update(num_steps=16, checkpoint_every=1)
    headers = {"Authorization": f"Bearer {stack['token']}"}
    job = httpx.post(f"{stack['api'].url}/api/v1/jobs", json={"spec": spec}, headers=headers).json()["id"]
    page.goto(stack["base"])
    sign_in(page, stack["token"])
    page.goto(f"{stack['base']}/job?job={job}")
    wait_text(page, r"running · .*step [1-6]/16", timeout_s=300)  # past its first checkpoint, 10 steps to go
    page.get_by_role("button", name="Cancel…").click()
    dialog = page.get_by_role("dialog")
    dialog.wait_for()
    time.sleep(4)  # longer than the page's refresh: the dialog stays open while the job runs on
    dialog.get_by_role("button", name="Cancel the job").click()  # the confirmation
    wait_text(page, r"Cancel requested|follow-me · cancelled", timeout_s=60)  # the click landed
    wait_text(page, r"follow-me · cancelled", timeout_s=240)  # the header, followed without a reload
    page.get_by_role("button", name="Resume").wait_for()
    page.get_by_role("button", name="Cancel…").wait_for(state="detached", timeout=60_000)  # the redraw done
    shot(page, "10-job-cancelled")
    page.get_by_role("button", name="Resume").click()
    wait_text(page, r"follow-me · (queued|starting|running) · ", timeout_s=60)
    wait_text(page, r"follow-me · succeeded · .*step 16/16", timeout_s=400)  # no reload: the page followed the job
    wait_text(page, "over 2 attempts")
    page.get_by_role("button", name="Cancel…").wait_for(state="detached", timeout=30_000)  # a finished job's page
    assert not page.get_by_role("button", name="Resume").count()
    time.sleep(1)  # the redraw done (elements of the previous draw fade out)
    shot(page, "11-job-resumed-succeeded")
