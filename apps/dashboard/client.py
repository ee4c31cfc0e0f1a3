"""A small client of the Miles REST API: the dashboard's only way to the control plane."""

from __future__ import annotations

from typing import Any

import httpx


class ApiError(Exception):
    """An answer of 4xx/5xx, or no answer. `fields` maps a spec field path to its problem (422)."""

    def __init__(self, status: int | None, detail: Any) -> None:
        self.status, self.detail = status, detail
        self.fields: dict[str, str] = {}
        if isinstance(detail, list):
            for item in detail:
                loc = [str(p) for p in item.get("loc", [])]
                if loc[:2] == ["body", "spec"]:
                    loc = loc[2:]
                elif loc[:1] == ["body"]:
                    loc = loc[1:]
                self.fields[".".join(loc) or "(spec)"] = item.get("msg", "")
        super().__init__(self.message)

    @property
    def message(self) -> str:
        if self.fields:
            return "; ".join(f"{k}: {v}" for k, v in self.fields.items())
        prefix = f"{self.status}: " if self.status else ""
        return f"{prefix}{self.detail}"


class Api:
    """Typed calls of /api/v1. Every method raises ApiError with the server's message."""

    def __init__(self, url: str, token: str, timeout: float = 15.0) -> None:
        self.url = url.rstrip("/")
        self.http = httpx.Client(
            base_url=f"{self.url}/api/v1", headers={"Authorization": f"Bearer {token}"}, timeout=timeout
        )

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(None, f"cannot reach the Miles API at {self.url} ({type(exc).__name__})") from None
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise ApiError(response.status_code, detail)
        return response.json()

    # --- reads ----------------------------------------------------------------------------------
    def health(self) -> dict:
        return self._call("GET", "/health")

    def jobs(self, status: list[str] | None = None, name: str | None = None, limit: int = 100, offset: int = 0):
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if status:
            params["status"] = status
        if name:
            params["name"] = name
        return self._call("GET", "/jobs", params=params)

    def job(self, job_id: int) -> dict:
        return self._call("GET", f"/jobs/{job_id}")

    def metrics(self, job_id: int, names: list[str] | None = None) -> list[dict]:
        return self._call("GET", f"/jobs/{job_id}/metrics", params={"name": names} if names else None)

    def metric_names(self, job_id: int) -> list[str]:
        return self._call("GET", f"/jobs/{job_id}/metric-names")

    def spans(self, job_id: int, step_min: int | None = None, step_max: int | None = None) -> list[dict]:
        params = {k: v for k, v in (("step_min", step_min), ("step_max", step_max)) if v is not None}
        return self._call("GET", f"/jobs/{job_id}/spans", params=params)

    def choices(self, schema: str, field: str) -> list[str]:
        """The values the API accepts for `field` of a request `schema`, from its OpenAPI document (so the
        dashboard never spells them itself)."""
        try:
            response = self.http.get(f"{self.url}/openapi.json")
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise ApiError(None, f"cannot read the API's schema at {self.url} ({type(exc).__name__})") from None
        spec = response.json()["components"]["schemas"][schema]["properties"][field]
        for option in [spec, *spec.get("anyOf", [])]:
            if "enum" in option:
                return list(option["enum"])
        raise ApiError(None, f"the API's {schema}.{field} has no enumerated values")

    def summary(self, job_id: int) -> dict:
        """miles_control.summary.RunSummary as the API serves it (what `miles run` prints)."""
        return self._call("GET", f"/jobs/{job_id}/summary")

    def steps(self, job_id: int) -> list[dict]:
        return self._call("GET", f"/jobs/{job_id}/steps")

    def events(self, job_id: int, limit: int = 1000) -> list[dict]:
        return self._call("GET", f"/jobs/{job_id}/events", params={"limit": limit})

    def samples(self, job_id: int, step: int | None = None, limit: int = 200) -> list[dict]:
        params: dict[str, Any] = {"limit": limit}
        if step is not None:
            params["step"] = step
        return self._call("GET", f"/jobs/{job_id}/samples", params=params)

    def schedule_changes(self, job_id: int) -> list[dict]:
        return self._call("GET", f"/jobs/{job_id}/schedule-changes")

    # --- changes --------------------------------------------------------------------------------
    def create_job(self, spec: dict) -> dict:
        return self._call("POST", "/jobs", json={"spec": spec})

    def cancel(self, job_id: int) -> dict:
        return self._call("POST", f"/jobs/{job_id}/cancel")

    def resume(self, job_id: int) -> dict:
        return self._call("POST", f"/jobs/{job_id}/resume")

    def patch_schedule(self, job_id: int, patch: dict) -> dict:
        return self._call("PATCH", f"/jobs/{job_id}/schedule", json=patch)
