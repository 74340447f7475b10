#!/usr/bin/env bash
# Start `linserve serve` inside a built image and check it answers as a deployment needs:
#   bash docker/smoke_test.sh IMAGE [PORT]
# Uses buildah (Debian's package; `buildah run --isolation chroot` works where `podman run`/`docker run` cannot
# start containers) — with a Docker engine, `docker run -p 8000:8000 IMAGE` is the same check by hand.
set -euo pipefail
image=${1:?usage: docker/smoke_test.sh IMAGE [PORT]}
port=${2:-18080}
container=$(buildah from "$image")
trap 'pkill -TERM -f "linserve serve --port $port" || true; sleep 2; buildah rm "$container" >/dev/null' EXIT
buildah run --isolation chroot "$container" -- linserve serve --port "$port" > smoke_test.log 2>&1 &
for _ in $(seq 1 120); do curl -sf "localhost:$port/ready" >/dev/null && break; sleep 1; done
check() { echo "+ $1"; shift; "$@"; echo; }
check "ready"            curl -sf "localhost:$port/ready"
check "health"           curl -sf "localhost:$port/health"
check "completion"       curl -sf "localhost:$port/v1/completions" -H 'Content-Type: application/json' \
                              -d '{"prompt": "ROMEO.\n", "max_tokens": 20, "temperature": 0}'
check "session"          curl -sf "localhost:$port/v1/sessions" -H 'Content-Type: application/json' -d '{"prompt": "HAMLET."}'
check "runs as"          buildah run --isolation chroot "$container" -- id -un
check "healthcheck"      buildah run --isolation chroot "$container" -- python3 -c \
    "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=4).status)"
check "no source tree"   buildah run --isolation chroot "$container" -- sh -c 'test ! -e /src && test ! -e /app && echo none'
check "image size"       podman image inspect "$image" --format '{{.Size}}'
[ "$(buildah run --isolation chroot "$container" -- id -u)" != 0 ] || { echo "runs as root" >&2; exit 1; }
echo "smoke test passed"
