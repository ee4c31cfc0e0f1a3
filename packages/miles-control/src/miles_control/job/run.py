"""Run one job from a validated spec: data → model → Ray actors → schedule, recorded in the job's journal (the store,
which the caller opens: the loop never imports the service side, miles_control.job.journal).

`miles run` calls it in the terminal's process (a new job row, an "inline" attempt); the API's launcher
runs it in a driver process (`miles_control.service.driver`) for a job row and attempt it made already.
"""

from __future__ import annotations

import logging
import os
import socket
import traceback
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from miles_control.job.journal import JobJournal
from miles_control.job.recorder import Recorder
from miles_control.job.redact import masked
from miles_control.job.schedules.control import JobCancelled
from miles_control.job.status import FencedOut, InvalidTransition, JobStatus
from miles_control.spec.config import JobSpec

log = logging.getLogger(__name__)

PhaseCallback = Callable[[str], None]
StepCallback = Callable[[int, dict[str, float]], None]


def _finish(store: JobJournal, job_id: int, status: JobStatus, error: str | None = None) -> None:
    try:
        store.set_status(job_id, status, error=error)
    except InvalidTransition as exc:  # already final: e.g. marked failed by the API when the driver was lost
        log.warning("job %d: not marked %s: %s", job_id, status.value, exc)


def _worker_died(exc: BaseException) -> bool:
    """A Ray actor process of the job is gone (killed, crashed, out of memory): not an error of the job's code,
    which Ray reports as a task error instead."""
    import ray.exceptions

    return isinstance(exc, ray.exceptions.RayActorError)


def _restart(spec, store, recorder, runtime, exc, restarts, job_id, parts):
    """Replace a runtime whose worker died with a new one restored from the job's newest checkpoint (or from
    the start): the records after that checkpoint are discarded, so the final curve has each step once."""
    from miles_control.job.preflight import describe_error
    from miles_control.job.runtime.job import JobRuntime

    model_path, train_prompts, eval_prompts, run_dir = parts
    try:
        runtime.shutdown()
    except Exception:  # noqa: BLE001 - the dead worker's group is killed either way
        log.debug("shutdown of the failed runtime", exc_info=True)
    checkpoint = store.last_checkpoint(job_id)
    step = checkpoint.step if checkpoint is not None else 0
    deleted = store.discard_from(job_id, step + 1 if step else 0)
    recorder.event(
        "restart",
        f"a worker died ({describe_error(exc)}); restart {restarts} of {spec.schedule.max_restarts} from "
        + (f"the checkpoint of step {step}" if step else "the start")
        + f"; {deleted} records after it discarded",
        step=step,
        restart=restarts,
    )
    runtime = JobRuntime(spec, model_path, recorder, train_prompts, eval_prompts, run_dir / f"restart-{restarts}")
    if checkpoint is not None:
        runtime.restore(Path(checkpoint.path), step)
    else:
        runtime.start_weights()
    return runtime, step + 1


def run_job(
    spec: JobSpec,
    on_phase: PhaseCallback = lambda phase: None,
    on_step: StepCallback = lambda step, metrics: None,
    *,
    store: JobJournal,
    job_id: int | None = None,
    attempt_id: int | None = None,
    plugin_dirs: Sequence[str | Path] = (),
) -> int:
    """Run `spec` to the end, recorded in `store` (the job store: `Store(spec.store.url)`), and return its job id.
    The job's row says how it ended; on failure
    the exception propagates after the reason is stored, and everything recorded so far stays (an error
    raised inside a Ray actor propagates as the actor raised it, without Ray's wrapping).

    With `job_id` and `attempt_id` (a launched job, status `starting`), the attempt's `resume_step`
    says where to start: after the job's checkpoint of that step, or from scratch when 0. Modules in
    `plugin_dirs` (`miles run` passes the job file's folder) are importable here and in every worker."""
    from miles_control.job.preflight import add_plugin_dirs, describe_error, plain_error

    add_plugin_dirs(plugin_dirs)
    if job_id is None:
        job_id = store.create_job(
            spec.name, masked(spec.model_dump(mode="json")), status=JobStatus.STARTING
        )  # no password
        attempt = store.start_attempt(job_id, "inline", driver_pid=os.getpid(), driver_host=socket.gethostname())
    else:
        attempt = next(a for a in store.attempts(job_id) if a.id == attempt_id)
    store = store.fenced(attempt.id)  # every write checks that this attempt still owns the job
    recorder = Recorder(store, job_id)
    if spec.tracking:
        recorder.trackers = _start_trackers(spec, job_id, recorder)
    runtime = None
    started_ray = False
    outcome = "ended"
    try:
        on_phase("loading prompts")
        from miles_control.job.data import load_job_prompts

        train_prompts, eval_prompts = load_job_prompts(spec.data, spec.rollout.environment)
        on_phase("preparing model (built once, then cached)")
        from miles_control.job.assets import resolve_model_path

        model_path = resolve_model_path(spec)
        recorder.event("model", f"model folder {model_path}", path=str(model_path))
        on_phase("checking the job")
        from miles_control.job.preflight import check_job

        check_job(spec, model_path, [*train_prompts, *eval_prompts])
        on_phase("starting Ray actors")
        from miles_control.job.runtime.job import JobRuntime, ensure_ray
        from miles_control.job.schedules import SCHEDULES

        started_ray = ensure_ray(spec.ray)
        # Absolute (actors and servers have other working directories) and unique across stores.
        run_dir = Path(spec.output_dir).resolve() / f"job-{job_id}-{uuid.uuid4().hex[:8]}"
        recorder.event("run_dir", f"run folder {run_dir}", path=str(run_dir))
        runtime = JobRuntime(spec, model_path, recorder, train_prompts, eval_prompts, run_dir)
        first_step = 1
        if attempt.number > 1:  # a resume: roll the records back to the checkpoint, then redo from there
            deleted = store.discard_from(job_id, attempt.resume_step + 1 if attempt.resume_step else 0)
            recorder.event("resume", f"attempt {attempt.number}: records after step {attempt.resume_step} discarded "
                           f"({deleted} rows); they are redone", step=attempt.resume_step)  # fmt: skip
        if attempt.resume_step:
            checkpoint = next(c for c in store.checkpoints(job_id) if c.step == attempt.resume_step)
            runtime.restore(Path(checkpoint.path), checkpoint.step)
            first_step = checkpoint.step + 1
        else:
            runtime.start_weights()
        store.set_status(job_id, JobStatus.RUNNING, expect=JobStatus.STARTING)
        store.update_attempt(attempt.id, status="running")
        on_phase("running")
        restarts = 0
        while True:
            try:
                steps = SCHEDULES[spec.schedule.type](
                    runtime, spec.schedule, spec.rollout.eval.every_steps, on_step, first_step=first_step
                )
                break
            except Exception as exc:
                if not _worker_died(exc) or restarts >= spec.schedule.max_restarts:
                    raise
                restarts += 1
                on_phase(f"restarting ({restarts}/{spec.schedule.max_restarts}): a worker died")
                failed, runtime = runtime, None  # shut down by _restart; never twice if the new one fails
                runtime, first_step = _restart(spec, store, recorder, failed, exc, restarts, job_id,
                                               (model_path, train_prompts, eval_prompts, run_dir))  # fmt: skip
                on_phase("running")
        if spec.schedule.save_final:
            runtime.checkpoint(steps)
        store.set_status(job_id, JobStatus.SUCCEEDED)
        outcome = "succeeded"
    except FencedOut as exc:  # another attempt owns the job now: leave its records alone, write nothing more
        log.error("job %d: %s; stopping", job_id, exc)
        outcome = ""
        raise
    except (KeyboardInterrupt, JobCancelled) as exc:
        reason = "cancelled" if store.job(job_id).cancel_requested else f"interrupted ({type(exc).__name__})"
        _finish(store, job_id, JobStatus.CANCELLED, error=reason)
        outcome = reason
        raise
    except BaseException as exc:
        log.debug("job %d failed", job_id, exc_info=True)
        outcome = describe_error(exc)
        _finish(store, job_id, JobStatus.FAILED, error=outcome)
        recorder.event("error", outcome, trace=traceback.format_exc()[-4000:])
        plain = plain_error(exc)
        if plain is exc:
            raise
        raise plain from None  # the actor's own error; its remote traceback is in the event above
    finally:
        if outcome:
            try:
                store.end_attempt(attempt.id, outcome)
            except FencedOut as exc:
                log.error("job %d: %s", job_id, exc)
        if runtime is not None:
            runtime.shutdown()
        if recorder.trackers is not None:
            recorder.trackers.close()
        if started_ray:
            import ray

            ray.shutdown()
    return job_id


def _start_trackers(spec: JobSpec, job_id: int, recorder: Recorder):
    """The job's experiment trackers; each that starts is an event with its link (the dashboard shows it), each that
    cannot, or fails later, a warning in the log and the job's events."""
    from miles_control.job.tracking import Trackers

    def warn(message: str, kind: str) -> None:
        log.warning("%s", message)
        recorder.event("tracking", message, level="warning", type=kind)

    trackers = Trackers(spec, job_id, warn)
    for kind, link in trackers.links():
        recorder.event("tracking", f"{kind}: {link}", type=kind, link=link)
    return trackers
