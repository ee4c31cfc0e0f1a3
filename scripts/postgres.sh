#!/usr/bin/env bash
# Install (Debian packages, when missing and allowed) and start a PostgreSQL cluster on loopback, create the
# role and database Miles' tests use, and print its SQLAlchemy URL on stdout. Idempotent.
#   export MILES_TEST_PG_URL="$(bash scripts/postgres.sh)"
set -euo pipefail
DB="${MILES_PG_DB:-miles_test}"
ROLE="${MILES_PG_ROLE:-miles}"
PASSWORD="${MILES_PG_PASSWORD:-miles}"
PORT="${MILES_PG_PORT:-5432}"
log() { echo "[postgres] $*" >&2; }

if ! command -v pg_ctlcluster >/dev/null; then
  if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null; then
    log "PostgreSQL is not installed and this script can only install it as root with apt-get"; exit 1
  fi
  log "installing postgresql from Debian packages"
  log_file="$(mktemp)"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; } >"$log_file" 2>&1; then
    cat "$log_file" >&2; exit 1
  fi
fi
VERSION="$(ls /usr/lib/postgresql | sort -V | tail -1)"
if ! pg_lsclusters -h | awk '{print $1" "$2}' | grep -q "^$VERSION main$"; then
  pg_createcluster "$VERSION" main -p "$PORT" >&2
fi
if ! pg_lsclusters -h | awk '$1=="'"$VERSION"'" && $2=="main" {print $4}' | grep -q online; then
  log "starting cluster $VERSION/main on 127.0.0.1:$PORT"
  pg_ctlcluster "$VERSION" main start >&2
fi
as_pg() { if [[ "$(id -u)" == 0 ]]; then su postgres -c "$1"; else bash -c "$1"; fi; }
for _ in $(seq 1 30); do as_pg "psql -p $PORT -tAc 'select 1'" >/dev/null 2>&1 && break; sleep 0.5; done
if ! as_pg "psql -p $PORT -tAc \"select 1 from pg_roles where rolname='$ROLE'\"" | grep -q 1; then
  as_pg "psql -p $PORT -qc \"create role $ROLE login createdb password '$PASSWORD'\"" >&2
fi
if ! as_pg "psql -p $PORT -tAc \"select 1 from pg_database where datname='$DB'\"" | grep -q 1; then
  as_pg "createdb -p $PORT -O $ROLE $DB" >&2
fi
echo "postgresql+psycopg://$ROLE:$PASSWORD@127.0.0.1:$PORT/$DB"
