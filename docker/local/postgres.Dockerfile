# A PostgreSQL image from Debian's postgresql package, for machines that cannot pull
# postgres:17-alpine: the same interface as the official image where docker-compose.yml uses
# it (POSTGRES_USER, POSTGRES_PASSWORD_FILE or POSTGRES_PASSWORD, POSTGRES_DB, data in
# /var/lib/postgresql/data, pg_isready on PATH, port 5432). Built by scripts/compose_check.sh:
#   docker build -f docker/local/postgres.Dockerfile --build-arg DEBIAN=IMAGE docker/local
ARG DEBIAN=loader-search-local/debian:bookworm
FROM ${DEBIAN}

RUN set -eux; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql; \
    rm -rf /var/lib/apt/lists/*; \
    mkdir -p /var/lib/postgresql/data /var/run/postgresql; \
    chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql; \
    ln -s /usr/lib/postgresql/*/bin/pg_isready /usr/local/bin/pg_isready

COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint.sh
ENV PGDATA=/var/lib/postgresql/data
VOLUME /var/lib/postgresql/data
EXPOSE 5432
ENTRYPOINT ["/usr/local/bin/postgres-entrypoint.sh"]
CMD ["postgres"]
