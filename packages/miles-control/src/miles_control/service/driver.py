"""The driver of one launched job: `python -m miles_control.service.driver --job-id N --attempt-id M`, with the store's URL
in the environment variable MILES_DRIVER_STORE_URL.

Started by the API's launcher (a process of this machine, or a Ray job's entrypoint on a cluster). It
reads the job's spec from the store, joins the given Ray instance and runs the job. It stops before its
next step when the job's `cancel_requested` flag is set (the API's cancel) or on SIGINT; the job then
ends `cancelled`. (Ray's own handler owns SIGTERM in a driver once it is initialised.)"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from miles_control.job.redact import mask_credentials, mask_log_handlers
from miles_control.spec.config import JobSpec

# Where the launcher puts the store URL: it may carry the database password, and a command line is readable by every
# local user (/proc/PID/cmdline, ps), a process's environment only by its owner.
STORE_URL_ENV = "MILES_DRIVER_STORE_URL"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="miles-driver", description=__doc__)
    parser.add_argument("--job-id", type=int, required=True)
    parser.add_argument("--attempt-id", type=int, required=True)
    parser.add_argument(
        "--store",
        default=os.environ.get(STORE_URL_ENV),
        help=f"SQLAlchemy URL of the job store [env {STORE_URL_ENV}; prefer it: a command line is public]",
    )
    parser.add_argument("--ray-address", default=None, help="Ray instance to join; none starts one")
    parser.add_argument(
        "--engine-log-dir",
        default=None,
        help="Where the SGLang servers log when the spec leaves rollout.engine.log_dir unset (the API serves them)",
    )
    args = parser.parse_args(argv)
    if not args.store:
        parser.error(f"no store: set {STORE_URL_ENV} (or pass --store)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    mask_log_handlers()  # an error's message may quote the store URL (or another with a password)
    log = logging.getLogger("miles.driver")

    from miles_control.job.run import run_job
    from miles_control.job.schedules.control import STOP_REQUESTED, JobCancelled
    from miles_control.service.store import Store, StoreError

    shown = mask_credentials(args.store)
    log.info("job %d, attempt %d: store %s", args.job_id, args.attempt_id, shown)
    try:
        store = Store(args.store)
    except StoreError as exc:
        log.error("job %d: %s", args.job_id, exc)
        return 1
    job = store.job(args.job_id)
    data = dict(job.spec)
    # The run opens no store from its spec (it is handed `store`), and the spec reaches the workers and the trackers
    # (a W&B config, MLflow's spec.json): it names the store without its password.
    data["store"] = {**data.get("store", {}), "url": shown}
    data["ray"] = {**data.get("ray", {}), "address": args.ray_address}
    spec = JobSpec.model_validate(data)
    if args.engine_log_dir:  # where the engine's servers log when the spec names no folder
        spec.rollout.engine = spec.rollout.engine.with_log_dir(args.engine_log_dir)

    def on_signal(signum, frame):
        log.info("job %d: %s: stopping before the next step", job.id, signal.Signals(signum).name)
        STOP_REQUESTED.set()

    signal.signal(signal.SIGINT, on_signal)
    log.info("job %d (%s), attempt %d: starting", job.id, job.name, args.attempt_id)
    try:
        run_job(
            spec,
            on_phase=lambda phase: log.info("job %d: %s", job.id, phase),
            on_step=lambda step, metrics: log.info("job %d: step %d done", job.id, step),
            store=store,
            job_id=job.id,
            attempt_id=args.attempt_id,
        )
    except (JobCancelled, KeyboardInterrupt):
        log.info("job %d: cancelled", job.id)
        return 0
    except Exception:
        log.exception("job %d failed", job.id)
        return 1
    log.info("job %d: succeeded", job.id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
