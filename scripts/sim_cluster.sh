#!/usr/bin/env bash
# A simulated multi-node GPU cluster on one machine: a Ray head plus N worker nodes, each worker node in its
# own Linux network namespace with its own address, each declaring fake GPUs.
#
#   sudo scripts/sim_cluster.sh up   [STATE_DIR]   # prints RAY_ADDRESS=... and the token file
#   sudo scripts/sim_cluster.sh down [STATE_DIR]   # kills every process it started, removes namespaces + bridge
#
# Network: a bridge ${SIM_PREFIX}br in the root namespace holding ${SIM_SUBNET}.1/24 (the head binds there);
# node i lives in namespace ${SIM_PREFIX}n<i> with ${SIM_SUBNET}.<i+1>/24 on a veth pair to the bridge. No
# default route and no NAT: nothing can leave the test subnet. The run directory is on the host's filesystem,
# which every namespace sees (network namespaces share the mount namespace): the shared-storage assumption.
#
# Ray: the head runs no workers (`--num-cpus 0 --num-gpus 0`); each worker node `--num-gpus $SIM_GPUS
# --num-cpus $SIM_CPUS` and a custom resource `sim_node_<i>` (so tests can pin work to a node). Token auth is
# on (RAY_AUTH_MODE=token, a fresh random token in STATE_DIR/auth_token, mode 600): every client must set
# RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=$(cat STATE_DIR/auth_token). Actors that ask for GPUs get
# CUDA_VISIBLE_DEVICES from Ray as on a real cluster; torch (CPU build) sees no CUDA, so engines use gloo.
#
# Environment: SIM_SUBNET (default 10.213.0), SIM_NODES (2), SIM_GPUS (4), SIM_CPUS (1), SIM_PREFIX (rls),
# SIM_PORT (free port), RAY (the `ray` executable; default: next to this venv's python), SIM_OBJECT_STORE_MB (96).
# Needs root (CAP_NET_ADMIN) for `ip netns`; `up` exits 3 with the reason when namespaces are not permitted.
set -euo pipefail

ACTION=${1:-}
STATE=${2:-${SIM_STATE:-/tmp/rlstages-sim}}
SUBNET=${SIM_SUBNET:-10.213.0}
NODES=${SIM_NODES:-2}
GPUS=${SIM_GPUS:-4}
CPUS=${SIM_CPUS:-1}
PREFIX=${SIM_PREFIX:-rls}
STORE_MB=${SIM_OBJECT_STORE_MB:-96}
HERE=$(cd "$(dirname "$0")/.." && pwd)
RAY=${RAY:-$( [ -x "$HERE/.venv/bin/ray" ] && echo "$HERE/.venv/bin/ray" || command -v ray || echo ray)}
BRIDGE=${PREFIX}br
HEAD_IP=$SUBNET.1

ns() { echo "${PREFIX}n$1"; }

# Kill every process of a session started here (by session id, never by name).
kill_session() {
  local sid=$1 pids
  pids=$(ps -e -o pid=,sid= | awk -v s="$sid" '$2 == s {print $1}')
  [ -n "$pids" ] && kill -TERM $pids 2>/dev/null || true
  for _ in $(seq 50); do
    pids=$(ps -e -o pid=,sid= | awk -v s="$sid" '$2 == s {print $1}')
    [ -z "$pids" ] && return 0
    sleep 0.1
  done
  kill -KILL $pids 2>/dev/null || true
}

down() {
  local i
  for i in $(ip netns list | awk '{print $1}' | sed -n "s/^${PREFIX}n\([0-9]*\)$/\1/p" | sort -rn); do
    # worker nodes first: every process in the namespace
    if true; then
      local pids
      pids=$(ip netns pids "$(ns "$i")" || true)
      [ -n "$pids" ] && kill -TERM $pids 2>/dev/null || true
      for _ in $(seq 50); do
        pids=$(ip netns pids "$(ns "$i")" || true)
        [ -z "$pids" ] && break
        sleep 0.1
      done
      [ -n "$pids" ] && kill -KILL $pids 2>/dev/null || true
      ip netns del "$(ns "$i")" 2>/dev/null || true
    fi
    ip link del "${PREFIX}v$i" 2>/dev/null || true
  done
  if [ -f "$STATE/head.sid" ]; then kill_session "$(cat "$STATE/head.sid")"; fi
  ip link del "$BRIDGE" 2>/dev/null || true
  rm -rf "$STATE"
}

wait_log() {  # wait until a `ray start --block` log says it is up, or its process died
  local log=$1 pid=$2
  for _ in $(seq 1800); do
    grep -q "will now block" "$log" 2>/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || { echo "sim_cluster: ray start died, see $log" >&2; tail -20 "$log" >&2; return 1; }
    sleep 0.2
  done
  echo "sim_cluster: ray start did not come up within 360 s, see $log" >&2
  return 1
}

up() {
  if ! ip netns add "${PREFIX}probe" 2>/tmp/sim_cluster_probe.err; then
    echo "sim_cluster: ip netns not permitted here: $(cat /tmp/sim_cluster_probe.err)" >&2
    exit 3
  fi
  ip netns del "${PREFIX}probe"
  if ip -br addr | grep -q " $SUBNET\."; then
    echo "sim_cluster: $SUBNET.0/24 is already in use on this host (a leftover? run: $0 down $STATE)" >&2
    exit 2
  fi
  [ -x "$RAY" ] || { echo "sim_cluster: no ray executable at $RAY (set RAY=...)" >&2; exit 2; }
  mkdir -p "$STATE"
  chmod 700 "$STATE"
  local port=${SIM_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
  python3 -c 'import secrets; print(secrets.token_hex(32))' >"$STATE/auth_token"
  chmod 600 "$STATE/auth_token"
  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN
  RAY_AUTH_TOKEN=$(cat "$STATE/auth_token")
  export RAY_USAGE_STATS_ENABLED=0
  export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1  # a multi-node cluster (a local Ray of the caller may have set 0)

  ip link add "$BRIDGE" type bridge
  ip addr add "$HEAD_IP/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  local i
  for ((i = 1; i <= NODES; i++)); do
    ip netns add "$(ns "$i")"
    ip link add "${PREFIX}v$i" type veth peer name eth0 netns "$(ns "$i")"
    ip link set "${PREFIX}v$i" master "$BRIDGE" up
    ip netns exec "$(ns "$i")" ip link set lo up
    ip netns exec "$(ns "$i")" ip addr add "$SUBNET.$((i + 1))/24" dev eth0
    ip netns exec "$(ns "$i")" ip link set eth0 up
  done

  local common=(--block --disable-usage-stats --object-store-memory $((STORE_MB << 20)))
  setsid "$RAY" start --head --node-ip-address "$HEAD_IP" --port "$port" --num-cpus 0 --num-gpus 0 \
    --include-dashboard false --temp-dir "$STATE/ray" "${common[@]}" >"$STATE/head.log" 2>&1 &
  local head=$!
  echo "$head" >"$STATE/head.sid"  # setsid: the child's pid is its session id
  wait_log "$STATE/head.log" "$head"
  for ((i = 1; i <= NODES; i++)); do
    ip netns exec "$(ns "$i")" setsid "$RAY" start --address "$HEAD_IP:$port" --node-ip-address "$SUBNET.$((i + 1))" \
      --num-gpus "$GPUS" --num-cpus "$CPUS" --resources "{\"sim_node_$i\": 1}" "${common[@]}" \
      >"$STATE/node$i.log" 2>&1 &
    echo $! >"$STATE/node$i.pid"
    wait_log "$STATE/node$i.log" "$!"
  done
  echo "$HEAD_IP:$port" >"$STATE/address"
  echo "RAY_ADDRESS=$HEAD_IP:$port"
  echo "RAY_AUTH_MODE=token RAY_AUTH_TOKEN=\$(cat $STATE/auth_token)"
}

# One more worker node (index N+1) joining a running cluster (tests: a node added later is used).
add_node() {
  local i=$1 address
  address=$(cat "$STATE/address")
  export RAY_AUTH_MODE=token RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_TOKEN RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1
  RAY_AUTH_TOKEN=$(cat "$STATE/auth_token")
  ip netns add "$(ns "$i")"
  ip link add "${PREFIX}v$i" type veth peer name eth0 netns "$(ns "$i")"
  ip link set "${PREFIX}v$i" master "$BRIDGE" up
  ip netns exec "$(ns "$i")" ip link set lo up
  ip netns exec "$(ns "$i")" ip addr add "$SUBNET.$((i + 1))/24" dev eth0
  ip netns exec "$(ns "$i")" ip link set eth0 up
  ip netns exec "$(ns "$i")" setsid "$RAY" start --address "$address" --node-ip-address "$SUBNET.$((i + 1))" \
    --num-gpus "$GPUS" --num-cpus "$CPUS" --resources "{\"sim_node_$i\": 1}" --block --disable-usage-stats \
    --object-store-memory $((STORE_MB << 20)) >"$STATE/node$i.log" 2>&1 &
  wait_log "$STATE/node$i.log" "$!"
}

# Kill one worker node: every process in its namespace (a node lost mid-step).
kill_node() {
  local pids
  pids=$(ip netns pids "$(ns "$1")" || true)
  [ -n "$pids" ] && kill -KILL $pids 2>/dev/null || true
}

case "$ACTION" in
  up) trap 'down' ERR; up ;;
  down) down ;;
  add-node) add_node "${3:?node index}" ;;
  kill-node) kill_node "${3:?node index}" ;;
  *) echo "usage: $0 up|down [STATE_DIR] | add-node|kill-node STATE_DIR INDEX" >&2; exit 2 ;;
esac
