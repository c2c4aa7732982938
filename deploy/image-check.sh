#!/usr/bin/env bash
# make image-check: build the cpu image for real and run the chart's pods as Docker containers.
#
#   1. start dockerd if no engine answers (overlay2), as root;
#   2. build a Debian base image once (debootstrap of the host's release + docker import, cached by
#      tag) and a Redis image from it with Debian's redis-server (no registry is needed);
#   3. build the cpu variant of deploy/Dockerfile on that base (BuildKit, --network host, the host's
#      CA bundle as a build secret, the host's pip index settings as build args, torch as the CPU
#      wheel the host's pip resolves, served to the build over loopback);
#   4. deploy/image_check.py: render the Helm chart with the cpu-dev values, run Redis, the init
#      container, gateway, draft and verify from the rendered command/args/env/securityContext on
#      a user-defined network, and check health, greedy output, migration on `docker stop`, user
#      and read-only root.
#
# Not part of `make test`: it needs root, a Docker engine and several minutes.
# Settings (environment): IMAGE (tandem), BASE_IMAGE (tandem-base:<release>), REDIS_IMAGE,
# DEBIAN_RELEASE / DEBIAN_MIRROR (default: the host's, from its apt sources), MODELS_DIR (the
# preset cache's models folder, default $HOME/.cache/tandem/models), PY (.venv/bin/python),
# DOCKER (a docker CLI that can build with the engine's built-in BuildKit), CHECK_ARGS (passed to
# deploy/image_check.py, e.g. --keep). `deploy/image-check.sh --build-only` stops after step 3.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
IMAGE=${IMAGE:-tandem}
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
TAG="$IMAGE:$VERSION-cpu"
. /etc/os-release
DEBIAN_RELEASE=${DEBIAN_RELEASE:-$VERSION_CODENAME}
BASE_IMAGE=${BASE_IMAGE:-tandem-base:$DEBIAN_RELEASE}
REDIS_IMAGE=${REDIS_IMAGE:-tandem-redis-debian:$DEBIAN_RELEASE}
MODELS_DIR=${MODELS_DIR:-$HOME/.cache/tandem/models}
WORK=$(mktemp -d)
HTTP_PID=""
cleanup() { [ -n "$HTTP_PID" ] && kill "$HTTP_PID" 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT
say() { printf '\n== %s\n' "$*"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# ---- a docker CLI that builds with the engine's own BuildKit ----
# A CLI of version 23 or later builds through the buildx plugin; without it, an older CLI (such as
# Debian's docker.io) still drives the engine's built-in BuildKit with DOCKER_BUILDKIT=1.
pick_docker() {
  if [ -n "${DOCKER:-}" ]; then return; fi
  local cli
  for cli in $(type -ap docker); do
    if "$cli" buildx version >/dev/null 2>&1; then DOCKER=$cli; return; fi
    local major
    major=$("$cli" --version | sed -n 's/^Docker version \([0-9]*\)\..*/\1/p')
    if [ -n "$major" ] && [ "$major" -lt 23 ]; then DOCKER=$cli; return; fi
  done
  echo "no docker CLI that can use BuildKit (install the buildx plugin or Debian's docker.io)" >&2
  exit 1
}
pick_docker
export DOCKER DOCKER_BUILDKIT=1

# ---- 1. the engine ----
if ! "$DOCKER" info >/dev/null 2>&1; then
  DOCKERD_LOG=${DOCKERD_LOG:-${TMPDIR:-/tmp}/dockerd-image-check.log}
  say "starting dockerd (log: $DOCKERD_LOG)"
  command -v dockerd >/dev/null || { echo "dockerd missing: apt-get install -y docker.io" >&2; exit 1; }
  nohup dockerd --storage-driver=overlay2 >"$DOCKERD_LOG" 2>&1 &
  for _ in $(seq 60); do "$DOCKER" info >/dev/null 2>&1 && break; sleep 1; done
  "$DOCKER" info >/dev/null
fi
echo "docker CLI $("$DOCKER" --version), engine $("$DOCKER" version -f '{{.Server.Version}}')"

# ---- 2. base images, once ----
if [ -z "${DEBIAN_MIRROR:-}" ]; then
  DEBIAN_MIRROR=$(sed -n 's/^URIs: *\([^ ]*\/debian\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)
  [ -n "$DEBIAN_MIRROR" ] || DEBIAN_MIRROR=$(awk '$1 == "deb" && $2 ~ /\/debian\/?$/ { print $2; exit }' /etc/apt/sources.list 2>/dev/null || true)
fi
if ! "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  say "base image $BASE_IMAGE: debootstrap $DEBIAN_RELEASE"
  command -v debootstrap >/dev/null || { echo "debootstrap missing: apt-get install -y debootstrap" >&2; exit 1; }
  t=$(now)
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$DEBIAN_RELEASE" "$WORK/rootfs" "$DEBIAN_MIRROR" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log"; exit 1; }
  rm -rf "$WORK/rootfs/var/cache/apt/archives/"*.deb "$WORK/rootfs/var/lib/apt/lists/"*
  tar -C "$WORK/rootfs" -c . | "$DOCKER" import -c 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$WORK/rootfs"
  echo "base image built in $(since "$t") s"
fi
if ! "$DOCKER" image inspect "$REDIS_IMAGE" >/dev/null 2>&1; then
  say "redis image $REDIS_IMAGE (Debian's redis-server)"
  t=$(now)
  printf 'FROM %s\nRUN apt-get update && apt-get install -y --no-install-recommends redis-server && rm -rf /var/lib/apt/lists/*\n' \
    "$BASE_IMAGE" | "$DOCKER" build --network host -t "$REDIS_IMAGE" - >"$WORK/redis-build.log" 2>&1 \
    || { tail -30 "$WORK/redis-build.log"; exit 1; }
  echo "redis image built in $(since "$t") s"
fi

# ---- 3. the cpu image ----
say "building $TAG"
build_args=(--build-arg VARIANT=cpu --build-arg "PYTHON_IMAGE=$BASE_IMAGE")
# the host pip's index settings, never written down: environment first, then pip's configuration
index=${PIP_INDEX_URL:-$(python3 -m pip config get global.index-url 2>/dev/null || true)}
[ -n "$index" ] && build_args+=(--build-arg "PIP_INDEX_URL=$index")
extra=${PIP_EXTRA_INDEX_URL:-$(python3 -m pip config get global.extra-index-url 2>/dev/null || true)}
extra=$(printf '%s\n' $extra | { grep -v '^file:' || true; } | tr '\n' ' ' | sed 's/ *$//')   # local folders are not in the build
[ -n "$extra" ] && build_args+=(--build-arg "PIP_EXTRA_INDEX_URL=$extra")
ca=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
[ -n "$ca" ] || ca=$(python3 -c 'import ssl; print(ssl.get_default_verify_paths().cafile or "")')
[ -n "$ca" ] && [ -s "$ca" ] && build_args+=(--secret "id=pip-ca,src=$ca")
# torch: the wheel the host's pip picks for the pinned version; a CPU build (+cpu) is served to the
# build over loopback (--network host) so that pip does not fetch the CUDA build from the index.
torch_pin=$(sed -n 's/^ *"\(torch==[^"]*\)".*/\1/p' pyproject.toml)
if python3 -m pip download "$torch_pin" --no-deps --quiet -d "$WORK/wheels" >/dev/null 2>&1 \
   && ls "$WORK/wheels"/torch-*+cpu-*.whl >/dev/null 2>&1; then
  # a fixed port unless taken: the URL is a build arg, part of the layer cache's key
  port=$(python3 -c 'import socket, sys
s = socket.socket()
try: s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError: s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])' "${WHEELS_PORT:-38491}")
  python3 -m http.server --bind 127.0.0.1 --directory "$WORK/wheels" "$port" >/dev/null 2>&1 &
  HTTP_PID=$!
  build_args+=(--build-arg "PIP_FIND_LINKS=http://127.0.0.1:$port/")
  echo "torch: $(basename "$WORK"/wheels/torch-*.whl) from the host's pip"
else
  echo "torch: no CPU wheel from the host's pip; the index's build is used (large)"
fi
t=$(now)
"$DOCKER" build --network host -f deploy/Dockerfile "${build_args[@]}" -t "$TAG" . 2>&1 | tee "$WORK/build.log" | grep -E '^#[0-9]+ (DONE|ERROR|CACHED)|error|ERROR' | tail -40
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "build failed:"; tail -40 "$WORK/build.log"; exit 1; }
BUILD_S=$(since "$t")
[ -n "$HTTP_PID" ] && { kill "$HTTP_PID"; HTTP_PID=""; }
echo "build time: $BUILD_S s (layers already built are reused)"
"$DOCKER" image ls --format 'table {{.Repository}}:{{.Tag}}\t{{.Size}}' | grep -E "^($IMAGE|${BASE_IMAGE%%:*}|${REDIS_IMAGE%%:*}|REPOSITORY)" || true
[ "${1:-}" = "--build-only" ] && exit 0

# ---- 4. run the rendered chart ----
say "running the chart's pods (cpu-dev values) as containers"
"$PY" deploy/image_check.py --image "$TAG" --redis-image "$REDIS_IMAGE" --models "$MODELS_DIR" \
  --docker "$DOCKER" --build-seconds "$BUILD_S" ${CHECK_ARGS:-}
