"""Running jobs for the API: the launcher loop (`launcher.py`), the drivers it starts or watches
(`drivers.py`), the local Ray head it starts on demand (`local_ray.py`) and what it reads about processes
of this machine (`processes.py`)."""

from miles_control.service.launch.drivers import Driver, InlineRun, LocalDriver, RayJobDriver, driver_store_url
from miles_control.service.launch.launcher import Launcher
from miles_control.service.launch.local_ray import LocalRay
from miles_control.service.launch.processes import forget_ray_cluster, kill_process_group

__all__ = [
    "Driver",
    "InlineRun",
    "Launcher",
    "LocalDriver",
    "LocalRay",
    "RayJobDriver",
    "driver_store_url",
    "forget_ray_cluster",
    "kill_process_group",
]
