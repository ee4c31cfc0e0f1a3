"""The REST API of the control plane: `create_app(settings)` (FastAPI), run by `miles serve`."""
