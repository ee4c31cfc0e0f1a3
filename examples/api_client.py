"""Launch a job through the REST API, follow its events as they happen, then print where its time went.

    export MILES_TOKEN=$(miles tokens create --name me --scope admin)
    miles serve &
    python examples/api_client.py --steps 10

Only HTTP: this script needs httpx and PyYAML, not Miles (a dashboard or a notebook would do the same).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import httpx
import yaml


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--api", default=os.environ.get("MILES_API_URL", "http://127.0.0.1:8420"))
    parser.add_argument("--token", default=os.environ.get("MILES_TOKEN", ""))
    parser.add_argument("--spec", type=Path, default=Path(__file__).with_name("arithmetic.yaml"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--engine", default="hf", help="hf (in-process) or sglang")
    args = parser.parse_args()
    if not args.token:
        parser.error("no token: pass --token or set MILES_TOKEN (miles tokens create --name me --scope admin)")
    http = httpx.Client(base_url=f"{args.api}/api/v1", headers={"Authorization": f"Bearer {args.token}"}, timeout=30)

    spec = yaml.safe_load(args.spec.read_text())
    spec["name"] = f"api-client-{spec['name']}"
    spec["rollout"]["engine"] = {"type": args.engine}
    spec["rollout"]["num_prompts_per_step"] = 16
    spec["rollout"]["eval"] = {"every_steps": 5, "num_prompts": 100}
    spec["schedule"].update(num_steps=args.steps, max_minutes=None)
    response = http.post("/jobs", json={"spec": spec})
    if response.status_code != 201:
        print(f"refused ({response.status_code}): {response.json()['detail']}", file=sys.stderr)
        return 1
    job_id = response.json()["id"]
    print(f"job {job_id} created; following its events")

    status = "unknown"
    with http.stream("GET", f"/jobs/{job_id}/events/stream", timeout=None) as stream:
        kind = ""
        for line in stream.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                if kind == "end":
                    status = data["status"]
                else:
                    print(f"  [{kind}] {data['message']}")

    job = http.get(f"/jobs/{job_id}").json()
    print(f"job {job_id}: {status} after {job['last_step'] or 0} steps")
    if status != "succeeded":
        print(job["error"], file=sys.stderr)
        return 1
    per_stage: dict[str, float] = defaultdict(float)
    for span in http.get(f"/jobs/{job_id}/spans").json():
        per_stage[span["stage"]] += span["end"] - span["start"]
    for stage, seconds in sorted(per_stage.items(), key=lambda kv: -kv[1]):
        print(f"  {stage:<14} {seconds:7.2f} s")
    accuracy = http.get(f"/jobs/{job_id}/metrics", params={"name": "eval/accuracy"}).json()
    print("held-out accuracy by step: " + ", ".join(f"{p['step']}:{p['value']:.2f}" for p in accuracy))
    return 0


if __name__ == "__main__":
    sys.exit(main())
