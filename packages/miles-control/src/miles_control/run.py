"""Run one job from a validated spec: data → model → Ray actors → schedule, recorded in the store."""

from __future__ import annotations

import logging
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path

from miles_control.config import JobSpec
from miles_control.recorder import Recorder
from miles_control.store import JobStatus, Store

log = logging.getLogger(__name__)

PhaseCallback = Callable[[str], None]
StepCallback = Callable[[int, dict[str, float]], None]


def run_job(
    spec: JobSpec,
    on_phase: PhaseCallback = lambda phase: None,
    on_step: StepCallback = lambda step, metrics: None,
    store: Store | None = None,
) -> int:
    """Run `spec` to the end and return its job id. The job's row says how it ended; on failure
    the exception propagates after the reason is stored, and everything recorded so far stays."""
    store = store or Store(spec.store.url)
    job_id = store.create_job(spec.name, spec.model_dump(mode="json"))
    recorder = Recorder(store, job_id)
    runtime = None
    started_ray = False
    try:
        store.set_status(job_id, JobStatus.STARTING)
        on_phase("loading prompts")
        from miles_control.data import load_job_prompts

        train_prompts, eval_prompts = load_job_prompts(spec.data)
        on_phase("preparing model (built once, then cached)")
        from miles_control.assets import resolve_model_path

        model_path = resolve_model_path(spec)
        recorder.event("model", f"model folder {model_path}", path=str(model_path))
        on_phase("starting Ray actors")
        from miles_control.runtime.job import JobRuntime, ensure_ray
        from miles_control.schedules import SCHEDULES

        started_ray = ensure_ray(spec.ray)
        # Absolute (actors and servers have other working directories) and unique across stores.
        run_dir = Path(spec.output_dir).resolve() / f"job-{job_id}-{uuid.uuid4().hex[:8]}"
        recorder.event("run_dir", f"run folder {run_dir}", path=str(run_dir))
        runtime = JobRuntime(spec, model_path, recorder, train_prompts, eval_prompts, run_dir)
        store.set_status(job_id, JobStatus.RUNNING)
        on_phase("running")
        steps = SCHEDULES[spec.schedule.type](runtime, spec.schedule, spec.rollout.eval.every_steps, on_step)
        if spec.schedule.save_final:
            runtime.save(run_dir / "checkpoint")
            recorder.event("checkpoint", f"saved {run_dir / 'checkpoint'}", step=steps)
        store.set_status(job_id, JobStatus.SUCCEEDED)
    except KeyboardInterrupt:
        store.set_status(job_id, JobStatus.CANCELLED, error="interrupted")
        raise
    except BaseException as exc:
        log.debug("job %d failed", job_id, exc_info=True)
        store.set_status(job_id, JobStatus.FAILED, error=f"{type(exc).__name__}: {exc}")
        recorder.event("error", f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-4000:])
        raise
    finally:
        if runtime is not None:
            runtime.shutdown()
        if started_ray:
            import ray

            ray.shutdown()
    return job_id
