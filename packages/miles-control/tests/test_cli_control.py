"""`miles tokens …` on the store and `miles jobs …` against a real `miles serve` (launcher off)."""

import os
import subprocess
import sys

from miles_control.service.store import JobStatus
from miles_control.service.store.tokens import check_token


def miles(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "miles_control.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_tokens_create_list_revoke(store_url):
    env = {"MILES_STORE_URL": store_url}
    created = miles("tokens", "create", "--name", "ci-bot", "--scope", "admin", env=env)
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip()
    assert token.startswith("miles_") and "shown once" in created.stderr
    listed = miles("tokens", "list", env=env)
    assert "ci-bot" in listed.stdout and "admin" in listed.stdout and token not in listed.stdout
    bad = miles("tokens", "create", "--name", "x", "--scope", "root", env=env)
    assert bad.returncode == 2 and "scope must be one of read, admin" in bad.stderr
    assert miles("tokens", "revoke", "1", env=env).returncode == 0
    assert "ci-bot" not in miles("tokens", "list", env=env).stdout
    assert "ci-bot" in miles("tokens", "list", "--all", env=env).stdout
    missing = miles("tokens", "revoke", "99", env=env)
    assert missing.returncode == 2 and "no token 99" in missing.stderr


def test_jobs_commands_against_a_server(api):
    token = api.admin["Authorization"].removeprefix("Bearer ")
    env = {"MILES_API_URL": api.url, "MILES_TOKEN": token}
    job = api.create("cli-job")
    listed = miles("jobs", "list", env=env)
    assert listed.returncode == 0 and "cli-job" in listed.stdout and "queued" in listed.stdout
    api.store.add_metrics(job["id"], 0, {"eval/accuracy": 0.36})
    shown = miles("jobs", "show", str(job["id"]), env=env)
    assert "cli-job: queued" in shown.stdout and "eval/accuracy" in shown.stdout and "0.36" in shown.stdout
    cancelled = miles("jobs", "cancel", str(job["id"]), env=env)
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout
    again = miles("jobs", "cancel", str(job["id"]), env=env)
    assert again.returncode == 1 and "409" in again.stderr and "is cancelled" in again.stderr
    followed = miles("jobs", "events", str(job["id"]), "--follow", env=env)  # ends: the job is final
    assert followed.returncode == 0, followed.stderr
    assert "[status] queued → cancelled" in followed.stdout and "is cancelled" in followed.stdout
    resumed = miles("jobs", "resume", str(job["id"]), env=env)
    assert resumed.returncode == 0 and "queued (resumes after step 0)" in resumed.stdout
    assert api.store.job(job["id"]).status == JobStatus.QUEUED.value
    assert "[status] cancelled → queued" in miles("jobs", "events", str(job["id"]), env=env).stdout
    logs = miles("jobs", "logs", str(job["id"]), env=env)
    assert logs.returncode == 1 and "has no attempt yet" in logs.stderr
    unknown = miles("jobs", "show", "999", env=env)
    assert unknown.returncode == 1 and "404: no job 999" in unknown.stderr
    read_only = miles("jobs", "cancel", str(job["id"]), env={**env, "MILES_TOKEN": api.read["Authorization"][7:]})
    assert read_only.returncode == 1 and "403" in read_only.stderr and "read-only" in read_only.stderr
    no_token = miles("jobs", "list", env={**env, "MILES_TOKEN": ""})
    assert no_token.returncode == 2 and "no token" in no_token.stderr
    down = miles("jobs", "list", env={**env, "MILES_API_URL": "http://127.0.0.1:9"})
    assert down.returncode == 1 and "cannot reach the Miles API" in down.stderr
    assert check_token(api.store, token) is not None
    # names with terminal escape sequences are shown, not obeyed
    hostile = api.create("evil\x1b]0;pwned\x07\x1b[2J\r[bold]x")
    for args in (("jobs", "list"), ("jobs", "show", str(hostile["id"]))):
        printed = miles(*args, env={**env, "COLUMNS": "200"})
        assert printed.returncode == 0 and "\x1b" not in printed.stdout and "\x07" not in printed.stdout
        assert "\\x1b]0;pwned\\x07\\x1b[2J\\r[bold]x" in printed.stdout, printed.stdout


def test_serve_help_names_the_environment_variable_of_every_option():
    """Each `miles serve` option whose help names its MILES_* variable shows it in --help (rich markup must not eat
    a bracketed hint, as it ate `[env MILES_STORE_URL]`)."""
    import re
    from pathlib import Path

    import miles_control.cli.control as control

    named = set(re.findall(r"\[(MILES_[A-Z_]+)\]", Path(control.__file__).read_text()))
    assert {"MILES_STORE_URL", "MILES_DATA_DIR", "MILES_LAUNCHER"} <= named
    shown = subprocess.run(
        [sys.executable, "-m", "miles_control.cli.main", "serve", "--help"],
        capture_output=True, text=True, env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}, check=True,
    ).stdout  # fmt: skip
    missing = sorted(v for v in named if f"[{v}]" not in shown)
    assert not missing, f"--help lost {missing}"
