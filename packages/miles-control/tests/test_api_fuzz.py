"""schemathesis against the published OpenAPI spec of a real server: no input makes it answer 5xx, and every
answer conforms to the published document (status codes, content types, headers, body schemas, `Allow` on 405).

Coverage (boundary values of every parameter), fuzzing and stateful phases (links between operations:
create → get → cancel → resume …). The event stream is left out: it streams until its job ends, which
a fuzzed job never does; tests/test_api.py covers it."""

import os
import subprocess
import sys
from pathlib import Path

# 10 examples per operation by default, 25 in the extended tier (MILES_EXTENDED=1), more for a deeper search.
MAX_EXAMPLES = int(os.environ.get("MILES_FUZZ_EXAMPLES", "25" if os.environ.get("MILES_EXTENDED") == "1" else "10"))
SEED = os.environ.get("MILES_FUZZ_SEED", "7")


def test_no_input_makes_the_server_fail_or_leave_its_schema(api):
    cli = Path(sys.executable).with_name("schemathesis")
    result = subprocess.run(
        [
            str(cli),
            "run",
            f"{api.url}/openapi.json",
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
            "response_schema_conformance,allow_header_conformance",
            "-H",
            api.admin["Authorization"].join(["Authorization: ", ""]),
            "--max-examples",
            str(MAX_EXAMPLES),
            "--seed",
            SEED,
            "--phases",
            "coverage,fuzzing,stateful",
            "--exclude-operation-id",
            "stream_events",
            "--request-timeout",
            "30",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    assert "passed" in out and "generated" in out
