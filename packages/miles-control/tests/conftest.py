"""Store URLs for tests that run on both databases: a SQLite file, and a fresh PostgreSQL database when
MILES_TEST_PG_URL names a server (.ci/run starts one; locally: `export MILES_TEST_PG_URL=$(bash
scripts/postgres.sh)`)."""

import os
from dataclasses import dataclass

import httpx
import pytest

from miles_control.service.store import Store
from miles_control.service.store.tokens import create_token
from miles_control.testing.servers import PG_ENV, ApiServer, fresh_pg_database


def pytest_collection_modifyitems(config, items):
    """The fuzzer on SQLite is the extended tier (the root conftest.py): it finds the same API faults as on
    PostgreSQL, which CI runs, and the other API tests run on both stores."""
    for item in items:
        if "test_api_fuzz" in item.nodeid and item.nodeid.endswith("[sqlite]"):
            item.add_marker(pytest.mark.extended)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/miles.db"
        return
    base = os.environ.get(PG_ENV)
    if not base:
        pytest.skip(f"PostgreSQL not configured: set {PG_ENV} (e.g. $(bash scripts/postgres.sh))")
    with fresh_pg_database(base) as url:
        yield url


@dataclass
class Api:
    url: str
    store: Store
    admin: dict
    read: dict
    read_token_id: int

    def get(self, path, headers=None, **kw):
        return httpx.get(self.url + path, headers=self.read if headers is None else headers, timeout=30, **kw)

    def post(self, path, headers=None, **kw):
        return httpx.post(self.url + path, headers=self.admin if headers is None else headers, timeout=30, **kw)

    def patch(self, path, **kw):
        return httpx.patch(self.url + path, headers=self.admin, timeout=30, **kw)

    def create(self, name="job", **spec):
        r = self.post("/api/v1/jobs", json={"spec": {"name": name, **spec}})
        assert r.status_code == 201, r.text
        return r.json()


@pytest.fixture
def api(store_url, tmp_path):
    """`miles serve` (launcher off) on `store_url`, with an admin and a read-only token."""
    store = Store(store_url)
    admin_row, admin = create_token(store, "admin", "admin")
    read_row, read = create_token(store, "reader", "read")
    # No token cache: a revoke must apply to the very next request here.
    server = ApiServer(store_url, tmp_path, launcher="off", poll_interval_s="0.2", cpus="2", token_cache_s="0").start()
    yield Api(server.url, store, {"Authorization": f"Bearer {admin}"}, {"Authorization": f"Bearer {read}"}, read_row.id)
    server.stop()
    store.engine.dispose()
