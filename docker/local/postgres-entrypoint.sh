#!/bin/sh
# The official postgres image's start-up, for docker/local/postgres.Dockerfile: on a first
# start (an empty $PGDATA), initdb with POSTGRES_USER and its password (from
# POSTGRES_PASSWORD_FILE, else POSTGRES_PASSWORD) and create POSTGRES_DB; then run the server
# as the postgres user, listening on every address with password (scram-sha-256) logins.
# Arguments after "postgres" (e.g. -c max_connections=200) go to the server.
set -eu
bin=$(echo /usr/lib/postgresql/*/bin)
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }

if [ "${1:-}" = "postgres" ]; then shift; fi
mkdir -p "$PGDATA" /var/run/postgresql
chown postgres:postgres "$PGDATA" /var/run/postgresql
chmod 700 "$PGDATA"

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then
        password=$(cat "$POSTGRES_PASSWORD_FILE")
    else
        password=${POSTGRES_PASSWORD:-}
    fi
    if [ -z "$password" ]; then
        echo "postgres-entrypoint: set POSTGRES_PASSWORD_FILE (or POSTGRES_PASSWORD)" >&2
        exit 1
    fi
    pwfile=$(mktemp)
    printf '%s\n' "$password" > "$pwfile"
    chown postgres "$pwfile"
    as_postgres "$bin/initdb" --username="$user" --pwfile="$pwfile" --auth-local=trust \
        --encoding=UTF8 --locale=C.UTF-8 \
        --auth-host=scram-sha-256 -D "$PGDATA" > /dev/null
    rm -f "$pwfile"
    echo "listen_addresses = '*'" >> "$PGDATA/postgresql.conf"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    # Create the database on a server reachable over the socket only, then stop it.
    as_postgres "$bin/pg_ctl" -D "$PGDATA" -o "-c listen_addresses=''" -w start > /dev/null
    if [ "$db" != "postgres" ]; then
        as_postgres "$bin/psql" -v ON_ERROR_STOP=1 -U "$user" -d postgres \
            -c "CREATE DATABASE \"$db\" OWNER \"$user\"" > /dev/null
    fi
    as_postgres "$bin/pg_ctl" -D "$PGDATA" -m fast -w stop > /dev/null
    echo "postgres-entrypoint: initialised $PGDATA (user $user, database $db)"
fi
exec setpriv --reuid=postgres --regid=postgres --init-groups "$bin/postgres" -D "$PGDATA" "$@"
