"""Launch a job through the REST API, follow its events as they happen, then print where its time went.

    export MILES_TOKEN=$(miles tokens create --name me --scope admin)
    miles serve &
    python examples/api_client.py --steps 10

It uses the typed client that ships with miles-control (`miles_control.client.MilesClient`): each call
returns the API's own models (JobDetail, RunSummaryPublic, ...), and errors are `ApiError`s naming the field.
The client needs httpx and pydantic at run time, not torch or Ray.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from miles_control.client import ApiError, MilesClient


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
    client = MilesClient(args.api, args.token)

    spec = yaml.safe_load(args.spec.read_text())
    spec["name"] = f"api-client-{spec['name']}"
    spec["rollout"]["engine"] = {"type": args.engine}
    spec["rollout"]["num_prompts_per_step"] = 16
    spec["rollout"]["eval"] = {"every_steps": 5, "num_prompts": 100}
    spec["schedule"].update(num_steps=args.steps, max_minutes=None)
    try:
        job = client.create_job(spec)
    except ApiError as exc:
        print(f"refused ({exc.status}): {exc.message}", file=sys.stderr)
        return 1
    print(f"job {job.id} created; following its events")

    status = "unknown"
    for kind, data, _ in client.stream_events(job.id):
        if kind == "end":
            status = data["status"]
        else:
            print(f"  [{kind}] {data['message']}")

    job = client.job(job.id)
    print(f"job {job.id}: {status} after {job.last_step or 0} steps")
    if status != "succeeded":
        print(job.error, file=sys.stderr)
        return 1
    summary = client.summary(job.id)  # the numbers `miles run` prints
    for stage in sorted(summary.stages, key=lambda st: -st.total_s):
        print(f"  {stage.stage:<14} {stage.total_s:7.2f} s  {stage.share_of_wall:6.1%} of wall time")
    print(f"  weight update: mean {1000 * (summary.weight_sync_mean_s or 0):.1f} ms")
    print("held-out accuracy by step: " + ", ".join(f"{step}:{value:.2f}" for step, value in summary.eval_accuracy))
    return 0


if __name__ == "__main__":
    sys.exit(main())
