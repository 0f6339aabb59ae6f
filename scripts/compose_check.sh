#!/usr/bin/env bash
# The Docker stack, for real, on a machine without GPUs and without Docker Hub: build the
# images locally, start docker-compose.yml with two CPU workers (profile cpu), run
# a small study to completion through it, check what a team's first `docker compose up` would
# meet, and print a table. Exit status: 0 when every check passed.
#
#   bash scripts/compose_check.sh            # about 5 minutes once the base images exist
#
# What it makes, cached between runs (delete them with `docker rmi` to rebuild):
#   loader-search-local/debian:bookworm       debootstrap --variant=minbase (Debian's mirror)
#   loader-search-local/python-torch:VERSION  Debian's Python + a CPU torch wheel (pip download)
#   loader-search-local/postgres:bookworm     Debian's postgresql package
# and, every run, the project's image loader-search:local from docker/Dockerfile with
# --build-arg BASE_IMAGE=loader-search-local/python-torch:VERSION (the default base stays the
# CUDA image users need). Nothing is pulled from a registry.
#
# Needs: docker (a running dockerd; started here when it is not and we are root), Compose v1
# (docker-compose) or v2 (docker compose), debootstrap for the first base image. Settings:
# TORCH_VERSION (default: the torch of `python3`, else 2.13.0), DEBIAN_MIRROR, KEEP=1 (leave
# the stack and its volume up for a look), CHECK_TIMEOUT_S (the study's, default 900).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

PROJECT=lscheck                       # the compose project: containers lscheck_*, its volumes
STUDY=compose-check                   # studies/compose-check.toml
DEBIAN_IMAGE=loader-search-local/debian:bookworm
POSTGRES_IMAGE=loader-search-local/postgres:bookworm
APP_IMAGE=loader-search:local
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CHECK_TIMEOUT_S=${CHECK_TIMEOUT_S:-900}
DASHBOARD_PORT=${DASHBOARD_PORT:-18080}
POSTGRES_PORT=${POSTGRES_PORT:-15432}
TORCH_VERSION=${TORCH_VERSION:-$(python3 -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || echo 2.13.0)}
PYTHON_IMAGE=loader-search-local/python-torch:$TORCH_VERSION

WORK=$(mktemp -d /tmp/compose-check.XXXXXX)
declare -a NAMES=() RESULTS=() DETAILS=()
FAILED=0

say() { printf 'compose-check: %s\n' "$*" >&2; }
check() {  # check NAME OK(0/1) DETAIL
  NAMES+=("$1"); DETAILS+=("$3")
  if [ "$2" = 0 ]; then RESULTS+=("ok"); else RESULTS+=("FAILED"); FAILED=1; fi
}
table() {
  printf '\n| check | result | detail |\n|---|---|---|\n'
  for i in "${!NAMES[@]}"; do
    printf '| %s | %s | %s |\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${DETAILS[$i]}"
  done
}
seconds_since() { echo $(( $(date +%s) - $1 )); }
ok() { if eval "$1"; then echo 0; else echo 1; fi; }  # ok 'CONDITION': 0 or 1, never exits
facts=""
field() {  # field KEY: a value of the study facts (inspect_study's JSON)
  python3 -c 'import json,sys; v=json.loads(sys.argv[1])[sys.argv[2]]; print(json.dumps(v) if isinstance(v,(dict,list)) else v)' "$facts" "$1"
}

# --- the engine and Compose --------------------------------------------------------------
if ! docker info > /dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v dockerd > /dev/null; then
    say "starting dockerd (log: /var/log/dockerd.log)"
    (setsid dockerd > /var/log/dockerd.log 2>&1 &)
    for _ in $(seq 60); do docker info > /dev/null 2>&1 && break; sleep 1; done
  fi
  docker info > /dev/null 2>&1 || { say "no Docker engine: apt-get install docker.io, start dockerd"; exit 2; }
fi
if docker compose version > /dev/null 2>&1; then
  COMPOSE=(docker compose)
elif command -v docker-compose > /dev/null; then
  COMPOSE=(docker-compose)
else
  say "no Compose: apt-get install docker-compose (or the compose plugin)"; exit 2
fi

# The study's password: a file, as a team keeps it (docs/docker.md). Random per run.
mkdir -m 700 "$WORK/secrets"
mkdir -m 1777 "$WORK/locks"  # the host lock's folder, shared by the worker containers
PASSWORD=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
printf '%s\n' "$PASSWORD" > "$WORK/secrets/postgres_password"
chmod 644 "$WORK/secrets/postgres_password"
cat > "$WORK/env" <<EOF
STUDY_CONFIG=$STUDY.toml
STUDY_NAME=$STUDY
POSTGRES_PASSWORD_FILE=$WORK/secrets/postgres_password
POSTGRES_PORT=$POSTGRES_PORT
DASHBOARD_PORT=$DASHBOARD_PORT
LOCKS_VOLUME=$WORK/locks
WORKER_SHM_SIZE=1gb
LOADER_SEARCH_IMAGE=$APP_IMAGE
EOF
# Local images instead of the registry's (the postgres image; the app image is built below).
cat > "$WORK/local.yml" <<EOF
services:
  postgres:
    image: $POSTGRES_IMAGE
EOF
compose() {
  "${COMPOSE[@]}" -p "$PROJECT" --env-file "$WORK/env" -f "$ROOT/docker-compose.yml" \
    -f "$WORK/local.yml" --profile cpu "$@"
}
cleanup() {
  if [ "${KEEP:-0}" = 1 ]; then
    say "KEEP=1: the stack and $WORK (its .env and secret) are kept; stop it with:"
    say "  ${COMPOSE[*]} -p $PROJECT --env-file $WORK/env -f docker-compose.yml -f $WORK/local.yml --profile cpu down -v; rm -rf $WORK"
  else
    compose down -v --remove-orphans > /dev/null 2>&1 || true
    rm -rf "$WORK"
  fi
}
trap cleanup EXIT

# --- 1. base images, cached ----------------------------------------------------------------
started=$(date +%s)
made=""
if ! docker image inspect "$DEBIAN_IMAGE" > /dev/null 2>&1; then
  made="$made debian"
  command -v debootstrap > /dev/null || { say "no debootstrap: apt-get install debootstrap"; exit 2; }
  say "debootstrap bookworm from $DEBIAN_MIRROR"
  debootstrap --variant=minbase bookworm "$WORK/rootfs" "$DEBIAN_MIRROR" > "$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
  tar -C "$WORK/rootfs" -c . | docker import - "$DEBIAN_IMAGE" > /dev/null
  rm -rf "$WORK/rootfs"
fi
if ! docker image inspect "$PYTHON_IMAGE" > /dev/null 2>&1; then
  made="$made python-torch"
  say "building $PYTHON_IMAGE"
  mkdir "$WORK/torch"
  python3 -m pip download -q --no-deps --only-binary=:all: "torch==$TORCH_VERSION" -d "$WORK/torch"
  # What the host's pip trusts (a TLS proxy in front of PyPI has a CA of its own).
  cp "${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}" "$WORK/torch/ca-bundle.crt"
  docker build -q -f docker/local/python-torch.Dockerfile --build-arg "DEBIAN=$DEBIAN_IMAGE" \
    -t "$PYTHON_IMAGE" "$WORK/torch" > /dev/null
fi
if ! docker image inspect "$POSTGRES_IMAGE" > /dev/null 2>&1; then
  made="$made postgres"
  say "building $POSTGRES_IMAGE"
  docker build -q -f docker/local/postgres.Dockerfile --build-arg "DEBIAN=$DEBIAN_IMAGE" \
    -t "$POSTGRES_IMAGE" docker/local > /dev/null
fi
check "base images" 0 "$(seconds_since "$started") s (made:${made:- none, all cached})"

# --- 2. the project's image ------------------------------------------------------------------
started=$(date +%s)
if docker build -f docker/Dockerfile --build-arg "BASE_IMAGE=$PYTHON_IMAGE" -t "$APP_IMAGE" . \
    > "$WORK/build.log" 2>&1; then
  size=$(docker image inspect -f '{{.Size}}' "$APP_IMAGE")
  check "image build" 0 "$(seconds_since "$started") s, $((size / 1000000)) MB ($APP_IMAGE on $PYTHON_IMAGE)"
else
  tail -30 "$WORK/build.log" >&2
  check "image build" 1 "docker build failed (log above)"
  table; exit 1
fi

# --- 3. the stack, two CPU workers, a study to completion --------------------------------------
compose down -v --remove-orphans > /dev/null 2>&1 || true
started=$(date +%s)
if ! compose up -d --no-build --scale worker=0 --scale worker-cpu=2 > "$WORK/up.log" 2>&1; then
  cat "$WORK/up.log" >&2
  compose logs --no-color --tail=30 >&2 || true
  check "compose up" 1 "failed (log above)"; table; exit 1
fi
workers=$(compose ps -q worker-cpu)
deadline=$(( $(date +%s) + CHECK_TIMEOUT_S ))
running=1
while [ "$running" = 1 ] && [ "$(date +%s)" -lt "$deadline" ]; do
  running=0
  for id in $workers; do
    [ "$(docker inspect -f '{{.State.Running}}' "$id")" = true ] && running=1
  done
  [ "$running" = 1 ] && sleep 5
done
codes=$(for id in $workers; do docker inspect -f '{{.State.ExitCode}}' "$id"; done | tr '\n' ' ')
study_s=$(seconds_since "$started")
if [ "$running" = 1 ]; then
  check "study finished" 1 "workers still running after ${CHECK_TIMEOUT_S} s"
else
  check "study finished" "$(ok '[ "$codes" = "0 0 " ]')" "${study_s} s from 'up' to both workers done; exit codes: $codes"
fi

# What the database holds, read by the project's own code in its image.
read -r -d '' INSPECT <<'EOF' || true
import json, os, sys, collections
import optuna
from loader_search.study import FAILURE_REASON, WORKER_ATTR, is_confirmation
from loader_search.study.work import uses_budget
from loader_search.team import resolve_storage_url
optuna.logging.set_verbosity(optuna.logging.WARNING)
rdb = optuna.storages.RDBStorage(resolve_storage_url(None))
study = optuna.load_study(study_name=sys.argv[1], storage=rdb)
trials = study.get_trials(deepcopy=False)
study_system = rdb.get_study_system_attrs(rdb.get_study_id_from_name(sys.argv[1]))
states = collections.Counter(t.state.name for t in trials)
per_worker = collections.Counter(
    str(t.user_attrs.get(WORKER_ATTR, "?")).rsplit(":", 1)[0] for t in trials if t.state.is_finished())
password = open(os.environ["LOADER_SEARCH_STORAGE_PASSWORD_FILE"]).read().strip()
attrs = json.dumps([study.user_attrs, study_system] + [[t.user_attrs, t.system_attrs] for t in trials], default=str)
print(json.dumps({
    "trials": len(trials), "states": states,
    "failed_without_reason": sum(t.state.name == "FAIL" and not t.user_attrs.get(FAILURE_REASON) for t in trials),
    "unfinished": sum(not t.state.is_finished() for t in trials),
    "search": sum(uses_budget(t) for t in trials if t.state.is_finished()),
    "confirmation": sum(is_confirmation(t) for t in trials),
    "budget": study.user_attrs.get("trial_budget"),
    "per_worker": per_worker,
    "password_in_attributes": password in attrs,
}))
EOF
inspect_study() {
  compose run -T --rm --no-deps --entrypoint python init -c "$INSPECT" "$STUDY" 2> "$WORK/inspect.err" | tail -1
}
facts=$(inspect_study) || true
if [ -z "$facts" ]; then
  cat "$WORK/inspect.err" >&2; check "trials" 1 "could not read the study"
else
  lost=$(field unfinished); reasonless=$(field failed_without_reason)
  search=$(field search); budget=$(field budget)
  check "trials" "$(ok '[ "$lost" = 0 ] && [ "$reasonless" = 0 ] && [ "$search" = "$budget" ]')" "$(field trials) trials $(field states); search $search of budget $budget, $(field confirmation) confirmation; $lost lost, $reasonless failed without a reason"
  per_worker=$(field per_worker)
  hosts=$(python3 -c 'import json,sys; print(len(json.loads(sys.argv[1])))' "$per_worker")
  check "trials per worker" "$(ok '[ "$hosts" = 2 ]')" "$per_worker (one trial at a time: the host lock)"
  check "password in study attributes" "$(ok '[ "$(field password_in_attributes)" = False ]')" "absent"
fi

# --- 4. the dashboard ----------------------------------------------------------------------------
code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 10 "http://127.0.0.1:$DASHBOARD_PORT/api/studies" || true)
check "dashboard on 127.0.0.1" "$(ok '[ "$code" = 200 ]')" "GET /api/studies: $code"
code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 10 -H 'Host: evil.example' "http://127.0.0.1:$DASHBOARD_PORT/api/studies" || true)
check "foreign Host header refused" "$(ok '[ "$code" = 403 ]')" "Host: evil.example: $code"
health=$(docker inspect -f '{{.State.Health.Status}}' "$(compose ps -q dashboard)" 2>/dev/null || echo none)
for _ in $(seq 24); do [ "$health" = healthy ] && break; sleep 5; health=$(docker inspect -f '{{.State.Health.Status}}' "$(compose ps -q dashboard)"); done
check "dashboard healthcheck" "$(ok '[ "$health" = healthy ]')" "$health"

# --- 5. the password: in no docker inspect, no log -------------------------------------------------
found=0
for id in $(compose ps -a -q); do
  docker inspect "$id" | grep -qF "$PASSWORD" && found=$((found + 1))
done
check "password in docker inspect" "$(ok '[ "$found" = 0 ]')" "found in $found of $(compose ps -a -q | wc -l) containers"
compose logs --no-color > "$WORK/logs.txt" 2>&1 || true
found=$(grep -cF "$PASSWORD" "$WORK/logs.txt" || true)
check "password in logs" "$(ok '[ "$found" = 0 ]')" "$found of $(wc -l < "$WORK/logs.txt") log lines"

# --- 6. down and up again: the volume keeps the study ---------------------------------------------
before=$( [ -n "$facts" ] && field trials || echo "?")
compose down > /dev/null 2>&1
left=$(docker ps -q --filter "label=com.docker.compose.project=$PROJECT" | wc -l)
check "down leaves no container" "$(ok '[ "$left" = 0 ]')" "$left running"
compose up -d --no-build --scale worker=0 --scale worker-cpu=0 > "$WORK/up2.log" 2>&1 || cat "$WORK/up2.log" >&2
facts=$(inspect_study) || true
after=$( [ -n "$facts" ] && field trials || echo "?")
check "study kept across down/up" "$(ok '[ "$after" = "$before" ] && [ "$before" != "?" ]')" "$before trials before, $after after"
compose down > /dev/null 2>&1
left=$(docker ps -q --filter "label=com.docker.compose.project=$PROJECT" | wc -l)
check "down again" "$(ok '[ "$left" = 0 ]')" "$left running"

table
exit "$FAILED"
