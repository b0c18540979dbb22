#!/usr/bin/env bash
# The deployment, checked on loopback: the container image, two replicas behind nginx, a bounded
# load through the router with the official OpenAI client, one replica killed mid-load, the other
# stopped with SIGTERM while it serves.
#
#   tools/deploy-check.sh [--build] [--throughput-only] [--out DIR]
#
# Steps (everything on 127.0.0.1, every load bounded in count and time):
#   1. the image (IMAGE, default localhost/gatestream:cpu): built from the repository's
#      Containerfile with --build or when it is missing (its size and build time are reported);
#   2. replicas A and B from it (ports 18081, 18082), --threads 1 each, the model mounted
#      read-only at /models; nginx with deploy/nginx/nginx.conf (18080: both, least connections;
#      18079: A alone);
#   3. throughput: the same load (REQUESTS requests, CONCURRENCY clients, MAX_TOKENS tokens each)
#      through A alone, then through both: the served tok/s of each and their ratio;
#   4. kill: the load through both again, B killed (SIGKILL) once KILL_AFTER requests have
#      ended: requests sent, served, failed (each a clean error), p50/p99 before and after;
#      A's /metrics; nginx's log of the requests it retried on A;
#   5. SIGTERM: CONCURRENCY requests straight to A, `stop` (SIGTERM, grace period) a second in:
#      every request in flight must finish.
# Exits non-zero when a request the survivor accepted was lost, a failure was not a clean error,
# or a request in flight at SIGTERM did not finish.
#
# Engine: podman (default; ENGINE=docker for docker with DOCKER_HOST). In sandboxes where crun
# cannot run (the development machine), CONTAINERS_CONF=deploy/podman/containers.conf (runc,
# explicit file limits); the script sets it when CONTAINERS_CONF is unset and runc is installed.
# Without registry access the base images come from deploy/image/local-bases.sh, and BUILDER
# names the local builder (set automatically when localhost/gatestream-rust:1.95-bookworm exists).
# Client: the `openai` package in ~/.cache/gatestream/openai-venv (made as .ci/run makes it).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

build=0
only_throughput=0
out=""
while [ $# -gt 0 ]; do
    case $1 in
        --build) build=1 ;;
        --throughput-only) only_throughput=1 ;;  # steps 1-3
        --out) out=$2; shift ;;
        *) echo "usage: $0 [--build] [--throughput-only] [--out DIR]" >&2; exit 2 ;;
    esac
    shift
done

ENGINE=${ENGINE:-podman}
IMAGE=${IMAGE:-localhost/gatestream:cpu}
MODEL=${MODEL:-${XDG_CACHE_HOME:-$HOME/.cache}/gatestream/models/SmolLM2-135M-Instruct.Q4_1.gguf}
THREADS=${THREADS:-1}
PARALLEL=${PARALLEL:-4}
REQUESTS=${REQUESTS:-48}
CONCURRENCY=${CONCURRENCY:-8}
MAX_TOKENS=${MAX_TOKENS:-32}
KILL_REQUESTS=${KILL_REQUESTS:-64}
KILL_AFTER=${KILL_AFTER:-16}
venv=${XDG_CACHE_HOME:-$HOME/.cache}/gatestream/openai-venv
out=${out:-$(mktemp -d /tmp/deploy-check.XXXXXX)}
mkdir -p "$out"

if [ "$ENGINE" = podman ] && [ -z "${CONTAINERS_CONF:-}" ] && command -v runc >/dev/null; then
    export CONTAINERS_CONF=$repo/deploy/podman/containers.conf
fi
[ -f "$MODEL" ] || { echo "no model at $MODEL (tools/fetch-models.sh smollm2)" >&2; exit 1; }
if ! "$venv/bin/python" -c "import openai" 2>/dev/null; then
    python3 -m venv "$venv" && "$venv/bin/pip" install -q "openai==3.57.0"
fi
command -v nginx >/dev/null || { echo "nginx is required (apt-get install nginx-light)" >&2; exit 1; }

log() { echo "$*" | tee -a "$out/report.txt"; }
: >"$out/report.txt"
log "deploy-check: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '?') $(date -u +%FT%TZ), engine $ENGINE, image $IMAGE"

# --- 1. the image ---
if [ $build = 1 ] || ! "$ENGINE" image inspect "$IMAGE" >/dev/null 2>&1; then
    args=()
    builder=${BUILDER:-}
    if [ -z "$builder" ] && "$ENGINE" image inspect localhost/gatestream-rust:1.95-bookworm >/dev/null 2>&1; then
        builder=localhost/gatestream-rust:1.95-bookworm
    fi
    [ -n "$builder" ] && args+=(--build-arg "BUILDER=$builder")
    [ "$ENGINE" = podman ] && args+=(--format docker)
    t=$(date +%s)
    "$ENGINE" build --network=host "${args[@]}" -t "$IMAGE" . >"$out/build.log" 2>&1 ||
        { tail -20 "$out/build.log" >&2; exit 1; }
    log "image: built in $(( $(date +%s) - t )) s (${args[*]})"
fi
size=$("$ENGINE" image inspect --format '{{.Size}}' "$IMAGE")
log "image: $IMAGE $(( size / 1000000 )) MB ($size bytes)"

# --- 2. replicas and the router ---
names=(gs-check-a gs-check-b)
ports=(18081 18082)
ngx=$out/nginx
cleanup() {
    [ -f "$ngx/nginx.pid" ] && kill "$(cat "$ngx/nginx.pid")" 2>/dev/null || true
    for n in "${names[@]}"; do "$ENGINE" rm -f "$n" >/dev/null 2>&1 || true; done
}
trap cleanup EXIT
cleanup
for i in 0 1; do
    "$ENGINE" run -d --name "${names[$i]}" -p "127.0.0.1:${ports[$i]}:8080" \
        -v "$(dirname "$MODEL"):/models:ro" "$IMAGE" \
        --model "/models/$(basename "$MODEL")" --threads "$THREADS" --parallel "$PARALLEL" \
        --shutdown-grace 20 >/dev/null
done
for i in 0 1; do
    t=$(date +%s)
    until curl -fsS "http://127.0.0.1:${ports[$i]}/health" >/dev/null 2>&1; do
        if [ $(( $(date +%s) - t )) -gt 120 ]; then
            "$ENGINE" logs "${names[$i]}" >&2; echo "replica ${names[$i]} not ready in 120 s" >&2; exit 1
        fi
        sleep 0.5
    done
done
log "replicas: ${names[0]} on 127.0.0.1:${ports[0]}, ${names[1]} on 127.0.0.1:${ports[1]} (--threads $THREADS --parallel $PARALLEL), ready"
log "replica user: $("$ENGINE" exec "${names[0]}" id)"
mkdir -p "$ngx/tmp"
cp deploy/nginx/nginx.conf "$ngx/"
nginx -t -p "$ngx/" -c nginx.conf 2>>"$out/report.txt"
nginx -p "$ngx/" -c nginx.conf
for _ in $(seq 50); do curl -fsS http://127.0.0.1:18080/health >/dev/null 2>&1 && break; sleep 0.1; done

# CPU time while a load runs: each replica's (its main process, all threads) and the whole
# machine's, to tell what the replicas got from what other work took (on a shared machine).
pids=()
for n in "${names[@]}"; do pids+=("$("$ENGINE" inspect --format '{{.State.Pid}}' "$n")"); done
hz=$(getconf CLK_TCK)
cpu_ticks() { # replica A's ticks, B's, the machine's busy ticks
    local p t=()
    for p in "${pids[@]}"; do t+=("$(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0)"); done
    echo "${t[@]} $(awk '/^cpu /{print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat) $(date +%s.%N)"
}
load() { # TAG deploy-load.py's arguments; the CPU figures go to $out/TAG.cpu too
    local tag=$1 c0 c1
    shift
    c0=$(cpu_ticks)
    "$venv/bin/python" tools/deploy-load.py "$@" | tee -a "$out/report.txt"
    c1=$(cpu_ticks)
    echo "$c0 $c1" | awk -v hz="$hz" '{w = $8 - $4; print ($5 > 0 ? ($5 - $1) / hz : -1), ($6 > 0 ? ($6 - $2) / hz : -1), w, ($7 - $3) / hz}' >"$out/$tag.cpu"
    echo "$c0 $c1" | awk -v hz="$hz" -v n="$(nproc)" '
        function r(name, t0, t1) { return t1 == 0 ? name " exited" : sprintf("%s %.1f s (%.2f cores)", name, (t1 - t0) / hz, (t1 - t0) / hz / w) }
        {w = $8 - $4; printf "   cpu over %.1f s: %s, %s; the whole machine busy %.2f of %d cores\n", w, r("replica A", $1, $5), r("B", $2, $6), ($7 - $3) / hz / w, n}' |
        tee -a "$out/report.txt"
}

# --- 3. throughput: one replica, then two ---
log ""
log "throughput: $REQUESTS requests, $CONCURRENCY clients, max_tokens $MAX_TOKENS, greedy"
load one --base-url http://127.0.0.1:18079/v1 --requests "$REQUESTS" --concurrency "$CONCURRENCY" \
    --max-tokens "$MAX_TOKENS" --label "one replica (A) via nginx" --json "$out/one.json"
load two --base-url http://127.0.0.1:18080/v1 --requests "$REQUESTS" --concurrency "$CONCURRENCY" \
    --max-tokens "$MAX_TOKENS" --label "two replicas via nginx" --json "$out/two.json"
"$venv/bin/python" - "$out" <<'EOF' | tee -a "$out/report.txt"
import json, sys
one = json.load(open(sys.argv[1] + "/one.json"))
two = json.load(open(sys.argv[1] + "/two.json"))
print(f"throughput: two replicas {two['tok_per_s']} tok/s / one {one['tok_per_s']} tok/s = "
      f"{two['tok_per_s'] / one['tok_per_s']:.2f}x")
# What the replicas got of the CPUs: on a machine whose cores other work shares, the ratio above
# is bounded by the cores the replicas got; tokens per replica CPU-second tell the rest.
c = {}
for k, r in (("one", one), ("two", two)):
    a, b, w, busy = map(float, open(f"{sys.argv[1]}/{k}.cpu").read().split())
    cpu = (a if k == "one" else a + b)
    c[k] = (cpu / w, r["generated_tokens"] / cpu, busy / w)
print(f"  replica cores used: one {c['one'][0]:.2f}, two {c['two'][0]:.2f} (machine busy {c['one'][2]:.2f} and "
      f"{c['two'][2]:.2f}); tokens per replica CPU-second: one {c['one'][1]:.1f}, two {c['two'][1]:.1f}")
EOF

[ $only_throughput = 1 ] && { log "report: $out/report.txt"; exit 0; }

# --- 4. one replica killed mid-load ---
log ""
before=$(curl -fsS http://127.0.0.1:18081/metrics)
log "kill: $KILL_REQUESTS requests, $CONCURRENCY clients through both; ${names[1]} killed (SIGKILL) after $KILL_AFTER ended"
: >"$ngx/access.log"
load kill --base-url http://127.0.0.1:18080/v1 --requests "$KILL_REQUESTS" --concurrency "$CONCURRENCY" \
    --max-tokens "$MAX_TOKENS" --kill-after "$KILL_AFTER" --kill-cmd "$ENGINE kill --signal KILL ${names[1]}" \
    --label "kill mid-load" --json "$out/kill.json"
after=$(curl -fsS http://127.0.0.1:18081/metrics)
metric() { echo "$1" | sed -n "s/^gatestream_$2 //p"; }
log "survivor ${names[0]} /metrics after the load:"
echo "$after" | grep -E '^gatestream_(requests|requests_rejected|requests_finished|requests_cancelled|steps_failed|generated_tokens)_total |^gatestream_(queue_depth|running|admitted|batch_width_mean) ' |
    sed 's/^/  /' | tee -a "$out/report.txt"
acc=$(( $(metric "$after" requests_total) - $(metric "$before" requests_total) ))
fin=$(( $(metric "$after" requests_finished_total) - $(metric "$before" requests_finished_total) ))
can=$(( $(metric "$after" requests_cancelled_total) - $(metric "$before" requests_cancelled_total) ))
log "survivor during this load: accepted $acc, finished $fin, cancelled $can"
retried=$(grep -c 'upstream=\[[^]]*, ' "$ngx/access.log" || true)
log "nginx: $(wc -l <"$ngx/access.log") requests logged; $retried retried on the other replica by nginx (never reached the first); statuses: $(awk '{print $2}' "$ngx/access.log" | sort | uniq -c | awk '{printf "%s×%s ", $1, $2}')"
grep 'upstream=\[[^]]*, \|" 50[0-9] \| 50[0-9] ' "$ngx/access.log" | sed 's/^/  nginx: /' | head -20 | tee -a "$out/report.txt" || true
rc=0
"$venv/bin/python" - "$out" "$acc" "$fin" "$can" "127.0.0.1:${ports[0]}" <<'EOF' | tee -a "$out/report.txt" || rc=1
import json, sys
out, acc, fin, can, a = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
k = json.load(open(out + "/kill.json"))
ok = True
if k["failed_unclean"]:
    print(f"FAIL: {k['failed_unclean']} failures were not clean errors"); ok = False
if fin != acc or can:
    print(f"FAIL: the survivor accepted {acc} and finished {fin} ({can} cancelled)"); ok = False
print(f"verdict: {k['requests_sent']} sent; {k['served']} served ({k['served_after_client_retry']} after a client "
      f"retry); {k['failed']} failed, all clean errors: {not k['failed_unclean']}; every request the survivor "
      f"accepted finished: {fin == acc and not can}")
sys.exit(0 if ok else 1)
EOF

# --- 5. SIGTERM: requests in flight finish ---
log ""
log "sigterm: $CONCURRENCY requests straight to ${names[0]}; \`$ENGINE stop -t 30 ${names[0]}\` (SIGTERM) 1 s in"
load term --base-url "http://127.0.0.1:${ports[0]}/v1" --requests "$CONCURRENCY" --concurrency "$CONCURRENCY" \
    --max-tokens "$MAX_TOKENS" --kill-at 1 --kill-cmd "$ENGINE stop -t 30 ${names[0]}" \
    --label "SIGTERM mid-load" --json "$out/term.json"
"$ENGINE" logs "${names[0]}" 2>&1 | grep -i "shutting down" | sed 's/^/  replica: /' | tee -a "$out/report.txt" || true
"$venv/bin/python" - "$out" <<'EOF' | tee -a "$out/report.txt" || rc=1
import json, sys
t = json.load(open(sys.argv[1] + "/term.json"))
g = t["latency_s"]["in_flight_at_kill"]
ok = g["n"] > 0 and g["ok"] == g["n"]
print(f"verdict: {g['ok']} of {g['n']} requests in flight at SIGTERM finished"
      f" ({t['served']} of {t['requests_sent']} served in all)" + ("" if ok else ": FAIL"))
sys.exit(0 if ok else 1)
EOF
log ""
log "report: $out/report.txt"
exit $rc
