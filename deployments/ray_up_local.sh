#!/usr/bin/env bash
# `ray up` for real on this machine: sshd on 127.0.0.1 with a generated key, the local-provider
# config (deployments/cluster_local.yaml.template), the app deployed with `serve deploy`, one
# request over HTTP to 127.0.0.1, then `ray down`. Bounded in time; cleans up on every exit
# path (success, failure, Ctrl-C, timeout).
#
#   deployments/ray_up_local.sh                 # needs root (apt-get, sshd on port 22)
#
# Environment:
#   FAIRBATCH_RAY_UP_TIMEOUT=300      whole run, seconds (each step has its own bound too)
#   FAIRBATCH_RAY_UP_GLOBAL_STOP=1    also run a plain `ray stop` at the end (as the launcher
#                                     recipe does). Off by default: it stops EVERY Ray of this
#                                     user on the machine. The script always stops its own
#                                     cluster's processes (found by its private temp dir).
#   FAIRBATCH_RAY_UP_KEEP=1           keep the work dir (logs) for inspection
set -Eeuo pipefail

TOTAL=${FAIRBATCH_RAY_UP_TIMEOUT:-300}
if [[ "${_FB_RAY_UP_INNER:-}" != 1 ]]; then
  # The whole run under `timeout`: TERM first (the trap below cleans up), KILL 60 s later.
  export _FB_RAY_UP_INNER=1
  exec timeout --signal=TERM --kill-after=60 "$TOTAL" "$0" "$@"
fi

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-$(command -v python3)}
RAY_BIN=$(dirname "$(command -v ray || echo "$(dirname "$PY")/ray")")
[[ -x "$RAY_BIN/ray" && -x "$RAY_BIN/serve" ]] || { echo "ray/serve not found next to $PY" >&2; exit 2; }
WORK=$(mktemp -d /tmp/fbup-XXXXXX)  # short: Ray's socket paths are capped at 107 bytes
NAME="fairbatch-local-$(basename "$WORK" | cut -d- -f2 | tr 'A-Z' 'a-z')"
CFG="$WORK/cluster.yaml"
SSHD_PID=""
APPENDED_KEY=""
log() { echo "[ray_up_local $(date +%H:%M:%S)] $*"; }

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  set +e
  log "cleaning up (exit status $rc)"
  if [[ -f "$CFG" ]]; then
    timeout 90 "$RAY_BIN/ray" down -y "$CFG" >"$WORK/ray_down.log" 2>&1 \
      || log "ray down failed (see $WORK/ray_down.log)"
  fi
  # `ray down` runs a plain `ray stop` over SSH, which is a no-op when `ray` is not on the login
  # shell's PATH: stop this cluster's processes here, by pid (they all carry $WORK in argv).
  local pids
  pids=$(pgrep -f -- "$WORK/ray" || true)
  if [[ -n "$pids" ]]; then
    kill $pids 2>/dev/null; sleep 3
    pids=$(pgrep -f -- "$WORK/ray" || true)
    [[ -n "$pids" ]] && kill -9 $pids 2>/dev/null
  fi
  if [[ "${FAIRBATCH_RAY_UP_GLOBAL_STOP:-0}" == 1 ]]; then
    timeout 60 "$RAY_BIN/ray" stop --force >/dev/null 2>&1
  fi
  [[ -n "$SSHD_PID" ]] && kill "$SSHD_PID" 2>/dev/null
  if [[ -n "$APPENDED_KEY" && -f "$HOME/.ssh/authorized_keys" ]]; then
    grep -vF -- "$APPENDED_KEY" "$HOME/.ssh/authorized_keys" >"$WORK/ak" || true
    cat "$WORK/ak" >"$HOME/.ssh/authorized_keys"
  fi
  rm -f "/tmp/cluster-$NAME.state" "/tmp/cluster-$NAME.lock"
  if [[ "${FAIRBATCH_RAY_UP_KEEP:-0}" == 1 ]]; then log "kept $WORK"; else rm -rf "$WORK"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---- 1. openssh-server and rsync ----------------------------------------------------------------
if [[ ! -x /usr/sbin/sshd ]] || ! command -v rsync >/dev/null; then
  [[ $(id -u) == 0 ]] || { log "need root to apt-get install openssh-server rsync"; exit 2; }
  log "installing openssh-server rsync"
  timeout 120 apt-get install -y -q openssh-server rsync >"$WORK/apt.log" 2>&1 \
    || { timeout 120 apt-get update -q >>"$WORK/apt.log" 2>&1 &&
         timeout 180 apt-get install -y -q openssh-server rsync >>"$WORK/apt.log" 2>&1; } \
    || { log "apt-get failed:"; tail -20 "$WORK/apt.log"; exit 1; }
fi

# ---- 2. a key, and sshd on 127.0.0.1:22 ---------------------------------------------------------
ssh-keygen -q -t ed25519 -N "" -C "fairbatch-ray-up-$NAME" -f "$WORK/id_ed25519"
ssh-keygen -q -t ed25519 -N "" -f "$WORK/host_ed25519"
cp "$WORK/id_ed25519.pub" "$WORK/authorized_keys"
mkdir -p /run/sshd
if (exec 3<>/dev/tcp/127.0.0.1/22) 2>/dev/null; then
  # An sshd is already there (the cluster launcher has no ssh_port setting): authorize our key
  # for it, and take the line out again on exit.
  log "port 22 is taken: using the running sshd"
  mkdir -p "$HOME/.ssh" && chmod 700 "$HOME/.ssh"
  APPENDED_KEY=$(cat "$WORK/id_ed25519.pub")
  echo "$APPENDED_KEY" >>"$HOME/.ssh/authorized_keys"
else
  /usr/sbin/sshd -p 22 -o ListenAddress=127.0.0.1 -h "$WORK/host_ed25519" \
    -o PidFile="$WORK/sshd.pid" -o AuthorizedKeysFile="$WORK/authorized_keys" \
    -o StrictModes=no -o PasswordAuthentication=no -o PermitRootLogin=prohibit-password \
    -E "$WORK/sshd.log"
  for _ in $(seq 50); do [[ -s "$WORK/sshd.pid" ]] && break; sleep 0.1; done
  SSHD_PID=$(cat "$WORK/sshd.pid")
  log "sshd running (pid $SSHD_PID)"
fi
timeout 20 ssh -i "$WORK/id_ed25519" -o BatchMode=yes -o StrictHostKeyChecking=no \
  -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR "$(whoami)@127.0.0.1" true \
  || { log "ssh to 127.0.0.1 with the generated key failed"; exit 1; }

# ---- 3. the configs ---------------------------------------------------------------------------
HTTP_PORT=$(free_port)
"$PY" - "$REPO/deployments/serve_config.yaml" "$WORK/serve_config.yaml" "$HTTP_PORT" <<'PYEOF'
import sys, yaml
src, dst, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = yaml.safe_load(open(src))
cfg["http_options"] = {"host": "127.0.0.1", "port": port}
cfg["proxy_location"] = "HeadOnly"
app = cfg["applications"][0]
app["args"].update(num_replicas=1, cluster_name="fblocal", metrics_interval_s=0,
                   engine={"max_num_seqs": 4, "num_gpu_blocks": 64, "device": "cpu"})
# the example's keys are held by nobody: a tenant with a key this script knows
app["args"]["tenants"].append({"name": "ray-up-check", "api_key": "sk-ray-up-local-check"})
yaml.safe_dump(cfg, open(dst, "w"), sort_keys=False)
PYEOF
sed -e "s|@CLUSTER_NAME@|$NAME|g" -e "s|@SSH_USER@|$(whoami)|g" \
  -e "s|@SSH_KEY@|$WORK/id_ed25519|g" -e "s|@WORK@|$WORK|g" -e "s|@RAY_BIN@|$RAY_BIN|g" \
  -e "s|@GCS_PORT@|$(free_port)|g" -e "s|@DASH_PORT@|$(free_port)|g" \
  -e "s|@AGENT_PORT@|$(free_port)|g" -e "s|@CLIENT_PORT@|$(free_port)|g" \
  -e "s|@NUM_GPUS@|1|g" \
  "$REPO/deployments/cluster_local.yaml.template" >"$CFG"

# ---- 4. ray up (starts Ray on the "head" over SSH and deploys the app) --------------------------
log "ray up $NAME"
RAY_USAGE_STATS_ENABLED=0 timeout 180 "$RAY_BIN/ray" up -y --no-config-cache "$CFG" \
  >"$WORK/ray_up.log" 2>&1 || { log "ray up failed:"; tail -40 "$WORK/ray_up.log"; exit 1; }
log "ray up done"

# ---- 5. one request over HTTP ---------------------------------------------------------------
URL="http://127.0.0.1:$HTTP_PORT"
for i in $(seq 180); do
  curl -sf -m 5 "$URL/health" >/dev/null 2>&1 && break
  [[ $i == 180 ]] && { log "no /health at $URL after 180 s"; tail -20 "$WORK/ray_up.log"; exit 1; }
  sleep 1
done
OUT=$(curl -sS -m 60 "$URL/v1/completions" -H 'Content-Type: application/json' \
  -H 'Authorization: Bearer sk-ray-up-local-check' \
  -d '{"model": "fairbatch-tiny", "prompt": "Hello from ray up", "max_tokens": 8}')
echo "$OUT"
echo "$OUT" | "$PY" -c 'import json, sys; r = json.load(sys.stdin); assert r["usage"]["completion_tokens"] >= 1, r'
log "OK: $URL answered a completion"
