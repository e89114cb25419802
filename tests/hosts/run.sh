#!/usr/bin/env bash
# Many hosts on one machine: each rank in its own network namespace with its own address, joined by
# a bridge inside a switch namespace, Redis on a host of its own. Needs root (ip netns).
#
#   tests/hosts/run.sh [BUILD]       # make test-hosts
#
# Scenarios (each prints its figure):
#   1. HSDP on a 2x2 mesh across 4 hosts equals the one-host run bit for bit (params and state).
#   2. The same with every frame delayed 20 +- 5 ms (so reordered): still bitwise.
#   3. The same with 5% of the frames dropped: still bitwise, only slower.
#   4. A host partitioned mid-step: every surviving rank exits with the named error in time.
#   5. A rank killed mid-run: the same.
#   6. Redis unreachable at rendezvous: a named error naming the address, in time.
#   7. A rank stopped (SIGSTOP) past the timeout: the others fail cleanly.
#   8. Restart: every host runs its rank under scripts/swapopt-launch, which restarts it after a
#      failure; a rank killed mid-run makes every rank resume from the last checkpoint, and the
#      run equals the uninterrupted one bitwise.
#   9. A rank that fails before the rendezvous, seen by its own host only: the other launchers
#      follow it into the next round (through Redis) within seconds, not the rendezvous timeout.
#  10. A rank that fails after the last collective, once the other hosts have finished: its
#      launcher ends at once with a named reason instead of restarting into a round nobody joins.
# Delay and loss come from tests/hosts/netswitch.cpp (these kernels have no netem): a second link
# per host, a TAP device joined by that userspace switch. Everything the harness made
# (namespaces, links, processes) is removed on exit, even when it is killed, and checked gone at
# the end.
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
HSDP=$PWD/$BUILD/examples/swapopt-hsdp
LAUNCH=$PWD/scripts/swapopt-launch
NETSWITCH=$PWD/$BUILD/tests/swapopt-netswitch
PREFIX=swo$$  # namespace and link names: unique to this run
SWITCH=$PREFIX-sw
HOSTS=4
REDIS_HOST=$HOSTS  # the fifth host
NET=10.77.$(($$ % 200 + 20))      # eth0: the kernel bridge
SLOW_NET=10.78.$(($$ % 200 + 20)) # eth1: the userspace switch, while a scenario runs it
LINK_NET=$NET                     # the network the ranks and Redis are reached on
TIMEOUT_MS=4000
RANK_TIMEOUT_MS=$TIMEOUT_MS  # the ranks' SWAPOPT_TIMEOUT_MS (longer across the slow switch)
STEPS=400  # long enough that a fault lands mid-run
# A collective's named error (not the rendezvous'): "[comm] all_gather on rank 0 of group 'shard.0' (world rank 0; ...)"
COLLECTIVE_ERROR="\[comm\] (all_gather|all_reduce|broadcast|barrier|reduce_scatter) on rank [0-9]+ of group '[^']+' \(world rank [0-9]+"
work=$(mktemp -d)
passed=0
failed=0

if [ "$(id -u)" -ne 0 ] || ! ip netns list > /dev/null 2>&1; then
  echo "test-hosts: skipped: needs root and ip netns"
  echo "tests: 0 passed, 0 failed, 1 skipped"
  exit 0
fi
[ -x "$HSDP" ] && [ -x "$NETSWITCH" ] || { echo "test-hosts: $HSDP or $NETSWITCH not built"; exit 1; }
command -v redis-server > /dev/null || scripts/install-deps.sh

host() { echo "$PREFIX-h$1"; }
addr() { echo "${2:-$NET}.$(($1 + 10))"; }  # host i's address on eth0 (or on the network given)

cleanup() {
  for ns in $(ip netns list | awk -v p="$PREFIX-" 'index($1, p) == 1 {print $1}'); do
    for pid in $(ip netns pids "$ns" 2> /dev/null); do kill -9 "$pid" 2> /dev/null; done
    ip netns del "$ns" 2> /dev/null
  done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

setup() {
  ip netns add "$SWITCH"
  ip -n "$SWITCH" link add br0 type bridge
  ip -n "$SWITCH" link set br0 up
  for i in $(seq 0 $HOSTS); do
    local ns
    ns=$(host "$i")
    ip netns add "$ns"
    # One veth pair per host, made inside the switch namespace so no link ever exists outside.
    ip -n "$SWITCH" link add "p$i" type veth peer name eth0 netns "$ns"
    ip -n "$SWITCH" link set "p$i" master br0 up
    ip -n "$ns" addr add "$(addr "$i")/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
  done
  # Static neighbours: address resolution on this bridge was seen to stall for seconds under load
  # (an INCOMPLETE entry for Redis), which is not what these scenarios test.
  for i in $(seq 0 $HOSTS); do
    local mac
    mac=$(ip -n "$(host "$i")" -o link show eth0 | grep -o 'link/ether [0-9a-f:]*' | cut -d' ' -f2)
    for j in $(seq 0 $HOSTS); do
      [ "$i" -eq "$j" ] || ip -n "$(host "$j")" neigh replace "$(addr "$i")" lladdr "$mac" dev eth0 nud permanent
    done
  done
}

start_redis() {
  # Bound to every address of its namespace: eth0 and, while the switch runs, eth1.
  ip netns exec "$(host $REDIS_HOST)" redis-server --bind 0.0.0.0 --protected-mode no --port 6379 --save '' --appendonly no \
    --daemonize yes --dir "$work" --logfile "$work/redis.log" --pidfile "$work/redis.pid" > /dev/null
  for _ in $(seq 100); do
    ip netns exec "$(host $REDIS_HOST)" redis-cli -h "$(addr $REDIS_HOST)" ping > /dev/null 2>&1 && return 0
    sleep 0.05
  done
  echo "redis did not start"; return 1
}

flush_redis() { ip netns exec "$(host $REDIS_HOST)" redis-cli -h "$(addr $REDIS_HOST)" flushall > /dev/null; }

# Starts rank i in host i (extra flags for swapopt-hsdp after the steps); its output in $work/rank$i.
start_rank() {
  local i=$1 steps=$2
  shift 2
  ip netns exec "$(host "$i")" env RANK="$i" WORLD_SIZE=$HOSTS LOCAL_RANK=0 SWAPOPT_REDIS="$(addr $REDIS_HOST "$LINK_NET"):6379" \
    SWAPOPT_HOSTNAME="$(addr "$i" "$LINK_NET")" SWAPOPT_TIMEOUT_MS=$RANK_TIMEOUT_MS OMP_NUM_THREADS=1 \
    "$HSDP" --mesh 2x2 --steps "$steps" "$@" > "$work/rank$i" 2>&1 &
  pids[$i]=$!
}

result() {  # name, ok (0/1), figure; inside attempt() only remembered
  if [ -n "${attempting:-}" ]; then
    last_name=$1 last_ok=$2 last_figure=$3
    return
  fi
  if [ "$2" -eq 0 ]; then
    passed=$((passed + 1)); echo "ok: $1: $3"
  else
    failed=$((failed + 1)); echo "FAILED: $1: $3"
  fi
}

# Runs a scenario (a function calling result once) up to three times while it fails: a network
# test on a shared 2-core machine sometimes sees a rank's first connection to Redis time out
# (seen for one rank in a few runs, the network reachable just before). Every failed attempt is
# printed, so a flake shows; only three failures in a row fail the scenario.
attempt() {
  attempting=1
  local tries=1
  "$@"
  while [ "$last_ok" -ne 0 ] && [ $tries -lt 3 ]; do
    echo "attempt $tries failed: $last_name: $last_figure"
    tries=$((tries + 1))
    "$@"
  done
  [ "$last_ok" -eq 0 ] && [ $tries -gt 1 ] && last_figure="$last_figure (attempt $tries; the failed ones above)"
  attempting=""
  result "$last_name" "$last_ok" "$last_figure"
}

wait_all() {  # waits for every rank; their exit codes in $codes (no subshell: it must be their parent)
  codes=""
  for i in $(seq 0 $((HOSTS - 1))); do
    wait "${pids[$i]}"
    codes+="$? "
  done
}

now_ms() { echo $(($(date +%s%N) / 1000000)); }

fingerprints() { grep -h '^fingerprint rank' "$@" | sort; }

# The userspace switch on eth1 of every host (Redis's too), with its flags (delay, jitter, loss);
# the ranks then talk over it. Its counts go to $work/switch when it stops.
start_switch() {
  local names=()
  for i in $(seq 0 $HOSTS); do names+=("$(host "$i")"); done
  ip netns exec "$SWITCH" "$NETSWITCH" --ifname eth1 "$@" "${names[@]}" > "$work/switch" 2>&1 &
  switch_pid=$!
  for _ in $(seq 100); do grep -q '^ready' "$work/switch" && break; sleep 0.05; done
  grep -q '^ready' "$work/switch" || { cat "$work/switch"; return 1; }
  for i in $(seq 0 $HOSTS); do
    ip -n "$(host "$i")" addr add "$(addr "$i" "$SLOW_NET")/24" dev eth1
    ip -n "$(host "$i")" link set eth1 up
  done
  for i in $(seq 0 $HOSTS); do  # static neighbours, as on eth0
    local mac
    mac=$(ip -n "$(host "$i")" -o link show eth1 | grep -o 'link/ether [0-9a-f:]*' | cut -d' ' -f2)
    for j in $(seq 0 $HOSTS); do
      [ "$i" -eq "$j" ] || ip -n "$(host "$j")" neigh replace "$(addr "$i" "$SLOW_NET")" lladdr "$mac" dev eth1 nud permanent
    done
  done
  LINK_NET=$SLOW_NET
}

stop_switch() {  # its TAP devices go with it
  kill -TERM "$switch_pid" 2> /dev/null
  wait "$switch_pid" 2> /dev/null
  LINK_NET=$NET
}

# Reference fingerprints: the same run on one host (the program's own local launcher), per steps.
local_fingerprints() {
  [ -s "$work/local$1" ] || OMP_NUM_THREADS=1 "$HSDP" --mesh 2x2 --steps "$1" --fingerprint > "$work/local$1" 2>&1
  fingerprints "$work/local$1"
}

# Trains `steps` steps across the 4 hosts (over the switch with its flags, if any are given) and
# compares every rank's fingerprint with the one-host run.
scenario_bitwise() {
  local name=$1 steps=$2
  shift 2
  flush_redis
  local over=""
  if [ $# -gt 0 ]; then
    start_switch "$@" || { result "$name" 1 "the switch did not start"; return; }
    RANK_TIMEOUT_MS=30000
  fi
  local t0=$SECONDS
  for i in $(seq 0 $((HOSTS - 1))); do start_rank "$i" "$steps" --fingerprint; done
  wait_all
  if [ $# -gt 0 ]; then
    stop_switch
    RANK_TIMEOUT_MS=$TIMEOUT_MS
    over="; $(grep '^netswitch:' "$work/switch")"
  fi
  local hosts_fp local_fp
  hosts_fp=$(fingerprints "$work"/rank*)
  local_fp=$(local_fingerprints "$steps")
  local ok=1
  [ "$codes" = "0 0 0 0 " ] && [ -n "$hosts_fp" ] && [ "$hosts_fp" = "$local_fp" ] && [ "$(echo "$hosts_fp" | wc -l)" -eq 4 ] && ok=0
  result "$name" $ok \
    "exit codes $codes, $steps steps in $((SECONDS - t0)) s$over; $(echo "$hosts_fp" | head -n 1) (and 3 more ranks, $( [ $ok -eq 0 ] && echo equal || echo DIFFERENT))"
  [ $ok -eq 0 ] || { echo "hosts:"; echo "$hosts_fp"; echo "one host:"; echo "$local_fp"; for i in 0 1 2 3; do echo "-- rank $i:"; tail -n 3 "$work/rank$i"; done; }
}

# Runs a fault against rank 3 after the run is under way; the other ranks must exit non-zero with
# the named error within the timeout plus a margin, none may hang.
scenario_fault() {
  local name=$1 fault=$2
  flush_redis
  for i in $(seq 0 $((HOSTS - 1))); do start_rank "$i" $STEPS; done
  local started=1
  for _ in $(seq 400); do grep -q '^step   10' "$work/rank0" 2> /dev/null && { started=0; break; }; sleep 0.05; done
  local t0
  t0=$(now_ms)
  eval "$fault"
  local codes="" ok=$started
  for i in 0 1 2; do
    local waited=0
    while kill -0 "${pids[$i]}" 2> /dev/null && [ $waited -lt 300 ]; do sleep 0.1; waited=$((waited + 1)); done
    if kill -0 "${pids[$i]}" 2> /dev/null; then ok=1; codes+="hung "; kill -9 "${pids[$i]}"; wait "${pids[$i]}" 2> /dev/null; continue; fi
    wait "${pids[$i]}"
    local code=$?
    codes+="$code "
    [ "$code" -ne 0 ] || ok=1
    grep -q -E "$COLLECTIVE_ERROR" "$work/rank$i" || ok=1
  done
  local seconds=$((($(now_ms) - t0) / 100))  # tenths
  { kill -9 "${pids[3]}"; wait "${pids[3]}"; } 2> /dev/null
  ip -n "$SWITCH" link set p3 up  # heal a partition for the next scenario, and wait until it carries
  for _ in $(seq 100); do
    ip netns exec "$(host 3)" redis-cli -h "$(addr $REDIS_HOST)" ping > /dev/null 2>&1 && break
    sleep 0.1
  done
  local error
  error=$(grep -h -o -E "$COLLECTIVE_ERROR.*" "$work/rank0" | head -n 1)
  [ $ok -eq 0 ] || for i in 0 1 2 3; do echo "-- rank $i:"; tail -n 3 "$work/rank$i"; done
  [ $ok -eq 0 ] || { ip -n "$(host 3)" neigh; ip -n "$SWITCH" link show p3; ip -n "$SWITCH" -s link show p3 | tail -4; }
  result "$name" $ok "ranks 0-2 exit codes $codes, all gone $((seconds / 10)).$((seconds % 10)) s after the fault; rank 0: ${error:-no error}"
}

scenario_redis_unreachable() {
  local t0=$SECONDS
  ip netns exec "$(host 0)" env RANK=0 WORLD_SIZE=$HOSTS SWAPOPT_REDIS="$NET.99:6379" SWAPOPT_HOSTNAME="$(addr 0)" \
    SWAPOPT_TIMEOUT_MS=$TIMEOUT_MS SWAPOPT_RENDEZVOUS_TIMEOUT_MS=$TIMEOUT_MS "$HSDP" --mesh 2x2 --steps 1 > "$work/unreachable" 2>&1
  local code=$? ok=1
  [ $code -ne 0 ] && grep -q "Redis at $NET.99:6379" "$work/unreachable" && [ $((SECONDS - t0)) -le $((TIMEOUT_MS / 1000 + 10)) ] && ok=0
  result "6. Redis unreachable at rendezvous" $ok \
    "exit $code after $((SECONDS - t0)) s: $(grep -o '\[comm\].*' "$work/unreachable" | head -n 1)"
}

# Starts host i's launcher (one restart allowed, rendezvous 60 s) running the given program.
start_launcher() {
  local i=$1
  shift
  ip netns exec "$(host "$i")" env OMP_NUM_THREADS=1 "$LAUNCH" --nnodes $HOSTS --node-rank "$i" \
    --redis "$(addr $REDIS_HOST):6379" --address "$(addr "$i")" --max-restarts 1 --run-id "hosts$$" \
    --timeout-ms $TIMEOUT_MS --rendezvous-timeout-ms 60000 -- "$@" > "$work/rank$i" 2>&1 &
  pids[$i]=$!
}

# Waits for every launcher (at most 120 s each); their exit codes in $codes.
wait_launchers() {
  codes=""
  for i in $(seq 0 $((HOSTS - 1))); do
    local waited=0
    while kill -0 "${pids[$i]}" 2> /dev/null && [ $waited -lt 1200 ]; do sleep 0.1; waited=$((waited + 1)); done
    kill -0 "${pids[$i]}" 2> /dev/null && { codes+="hung "; kill -9 "${pids[$i]}"; }
    wait "${pids[$i]}"
    codes+="$? "
  done
}

# Every host runs its rank under scripts/swapopt-launch (one restart allowed), checkpointing every
# 10 of 60 steps; rank 3 is killed after step 30. Every launcher restarts its rank, all resume from
# the newest checkpoint they all have, and the end equals the uninterrupted one-host run bitwise.
scenario_restart() {
  for i in $(seq 0 $((HOSTS - 1))); do  # nothing of an earlier attempt may write checkpoints now
    for pid in $(ip netns pids "$(host "$i")" 2> /dev/null); do kill -9 "$pid" 2> /dev/null; done
  done
  flush_redis
  local ckpt=$work/checkpoints steps=60
  rm -rf "$ckpt"
  local t0=$SECONDS
  for i in $(seq 0 $((HOSTS - 1))); do
    start_launcher "$i" "$HSDP" --mesh 2x2 --steps $steps --checkpoint-dir "$ckpt" --checkpoint-every 10 --fingerprint
  done
  for _ in $(seq 600); do grep -q '^step   30' "$work/rank0" 2> /dev/null && break; sleep 0.05; done
  local victim
  victim=$(pgrep -P "${pids[3]}" -f "$HSDP")
  local killed_at=$SECONDS
  [ -n "$victim" ] && kill -9 "$victim"
  wait_launchers
  local hosts_fp local_fp resumed restarts
  hosts_fp=$(fingerprints "$work"/rank*)
  local_fp=$(local_fingerprints $steps)
  resumed=$(grep -h -o 'resumed from step [0-9]*' "$work/rank0" | head -n 1)
  restarts=$(grep -l 'in round 0; restart 1 of 1' "$work"/rank* | wc -l)
  local ok=1
  [ -n "$victim" ] && [ "$codes" = "0 0 0 0 " ] && [ "$restarts" -eq 4 ] && [ -n "$resumed" ] && [ -n "$hosts_fp" ] &&
    [ "$hosts_fp" = "$local_fp" ] && [ "$(echo "$hosts_fp" | wc -l)" -eq 4 ] && ok=0
  result "8. rank 3 killed after step 30: every rank restarts from the last checkpoint, bitwise" $ok \
    "launchers exit $codes; $restarts of 4 restarted, $resumed, done $((SECONDS - killed_at)) s after the kill ($((SECONDS - t0)) s in all); $(echo "$hosts_fp" | head -n 1) (and 3 more ranks, $( [ $ok -eq 0 ] && echo "equal to the uninterrupted run" || echo DIFFERENT))"
  [ $ok -eq 0 ] || { echo "hosts:"; echo "$hosts_fp"; echo "one host:"; echo "$local_fp"; for i in 0 1 2 3; do echo "-- host $i:"; tail -n 5 "$work/rank$i"; done; }
}

# Host 3's program exits 3 in round 0, before its rendezvous; ranks 0-2 wait in theirs (60 s
# limit). Their launchers must see the round move and restart at once; round 1 trains to the end.
scenario_early_failure() {
  for i in $(seq 0 $((HOSTS - 1))); do
    for pid in $(ip netns pids "$(host "$i")" 2> /dev/null); do kill -9 "$pid" 2> /dev/null; done
  done
  flush_redis
  local t0=$SECONDS steps=20
  for i in 0 1 2; do start_launcher "$i" "$HSDP" --mesh 2x2 --steps $steps --fingerprint; done
  start_launcher 3 bash -c '[ "$SWAPOPT_RUN_ID" != "hosts'$$'.0" ] || exit 3; exec "$0" "$@"' "$HSDP" --mesh 2x2 --steps $steps --fingerprint
  wait_launchers
  local seconds=$((SECONDS - t0)) hosts_fp local_fp followed
  hosts_fp=$(fingerprints "$work"/rank*)
  local_fp=$(local_fingerprints $steps)
  followed=$(grep -l 'another host moved to round 1 in round 0' "$work"/rank[012] | wc -l)
  local ok=1
  [ "$codes" = "0 0 0 0 " ] && [ "$followed" -eq 3 ] && [ $seconds -lt 45 ] && [ -n "$hosts_fp" ] && [ "$hosts_fp" = "$local_fp" ] && ok=0
  result "9. a rank failing before the rendezvous: every host follows it to the next round" $ok \
    "launchers exit $codes; $followed of 3 other hosts followed host 3 into round 1 (rendezvous limit 60 s), all done in $seconds s; $( [ "$hosts_fp" = "$local_fp" ] && echo "equal to the one-host run" || echo DIFFERENT)"
  [ $ok -eq 0 ] || for i in 0 1 2 3; do echo "-- host $i:"; tail -n 5 "$work/rank$i"; done
}

# Host 3's program trains to the end with the others, then exits 3 (in round 0) two seconds after
# they have finished. Its launcher must not wait 60 s in a round-1 rendezvous nobody joins.
scenario_failure_after_finish() {
  for i in $(seq 0 $((HOSTS - 1))); do
    for pid in $(ip netns pids "$(host "$i")" 2> /dev/null); do kill -9 "$pid" 2> /dev/null; done
  done
  flush_redis
  local steps=10
  for i in 0 1 2; do start_launcher "$i" "$HSDP" --mesh 2x2 --steps $steps; done
  start_launcher 3 bash -c '"$0" "$@"; rc=$?; [ "$SWAPOPT_RUN_ID" != "hosts'$$'.0" ] || { sleep 2; exit 3; }; exit $rc' \
    "$HSDP" --mesh 2x2 --steps $steps
  wait_launchers
  local ended ok=1 said
  said=$(grep -o 'not restarted: a host already finished the job in round 0' "$work/rank3")
  # From host 3's program exiting to its launcher's end, by the launcher log's modification times.
  ended=$(( $(stat -c %Y "$work/rank3") - $(stat -c %Y "$work/rank0") ))
  [ "$codes" = "0 0 0 3 " ] && [ -n "$said" ] && [ $ended -lt 10 ] && ok=0
  result "10. a rank failing after the others finished: its launcher ends at once, not restarted" $ok \
    "launchers exit $codes; host 3 ended ${ended} s after host 0 (a restart would wait 60 s): $(grep -o 'swapopt-launch: .*' "$work/rank3" | head -n 1)"
  [ $ok -eq 0 ] || for i in 0 1 2 3; do echo "-- host $i:"; tail -n 5 "$work/rank$i"; done
}

pids=()
setup || { echo "test-hosts: could not make the namespaces"; exit 1; }
start_redis || exit 1
echo "test-hosts: $HOSTS hosts $NET.10-$NET.$((HOSTS + 9)), Redis at $(addr $REDIS_HOST):6379, timeout $TIMEOUT_MS ms"
attempt scenario_bitwise "1. 2x2 HSDP across 4 hosts equals one host bitwise" 20
attempt scenario_bitwise "2. every frame delayed 20 +- 5 ms (reordered): still bitwise" 8 --delay-ms 20 --jitter-ms 5 --seed 2
attempt scenario_bitwise "3. 5% of the frames dropped: still bitwise" 8 --delay-ms 1 --loss 0.05 --seed 3
# (stderr off: bash's own "Killed" notices of rank 3)
attempt scenario_fault "4. host 3 partitioned mid-run" 'ip -n "$SWITCH" link set p3 down' 2> /dev/null
attempt scenario_fault "5. rank 3 killed mid-run" 'kill -9 "${pids[3]}"' 2> /dev/null
attempt scenario_fault "7. rank 3 stopped past the timeout" 'kill -STOP "${pids[3]}"' 2> /dev/null
attempt scenario_redis_unreachable
attempt scenario_restart 2> /dev/null
attempt scenario_early_failure 2> /dev/null
attempt scenario_failure_after_finish 2> /dev/null

cleanup
trap - EXIT
left=$(ip netns list | grep -c "^$PREFIX-" || true)
procs=$(pgrep -f "$HSDP|$NETSWITCH|$LAUNCH" | wc -l)
result "cleanup: no namespace, link or process left" $([ "$left" -eq 0 ] && [ "$procs" -eq 0 ] && echo 0 || echo 1) \
  "$left namespaces, $procs processes"
echo "tests: $passed passed, $failed failed, 0 skipped"
[ "$failed" -eq 0 ]
