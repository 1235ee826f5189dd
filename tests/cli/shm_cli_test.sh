#!/usr/bin/env bash
# The shm side of the `duet` binary end to end: `duet shm status` on a live run, a
# SIGKILLed run's segments reported stale and then replaced by the next run, and
# `duet bench shm --quick --json` printing every figure for duet and Boost.
# Usage: shm_cli_test.sh path/to/duet
set -euo pipefail
duet=$1
name="duet-cli-test-$$"
fail() { echo "FAIL: $*" >&2; exit 1; }
# A segment is in /dev/shm, or in /dev/hugepages where hugetlbfs has room.
seg_exists() { [ -e "/dev/shm/$1" ] || [ -e "/dev/hugepages/$1" ]; }

"$duet" run -p "Count from one to a thousand, in words." -n 100000 --ignore-eos --ctx 4096 \
  --instance "$name" -t 1 >/dev/null 2>&1 &
pid=$!
trap 'kill -9 $pid 2>/dev/null || true; rm -f /dev/shm/duet.$name /dev/shm/duet.$name.kv /dev/hugepages/duet.$name.kv' EXIT
for _ in $(seq 100); do seg_exists "duet.$name" && break; sleep 0.1; done
sleep 0.5
status=$("$duet" shm status "$name" --json) || fail "shm status on a live run"
python3 - "$pid" <<PY || fail "status JSON: $status"
import json, sys
s = json.loads('''$status''')
p = [x for x in s["processes"] if x["pid"] == int(sys.argv[1])]
assert len(p) == 1 and p[0]["role"] == "runner" and p[0]["state"] == "running", s["processes"]
a = s["arenas"][0]
assert a["free"] + a["cached"] + a["held"] == a["blocks"], a
assert a["held"] >= 1 and a["users"][0]["refs"] == a["held"], a
assert s["kv_segment"]["path"].endswith(".kv")
PY
echo "status of a live run: ok"

kill -9 $pid
wait $pid 2>/dev/null || true
seg_exists "duet.$name" || fail "SIGKILL should leave the segment behind"
if out=$("$duet" shm status "$name" 2>&1); then fail "status of a dead run succeeded: $out"; fi
grep -q "stale" <<<"$out" || fail "expected a 'stale' message, got: $out"
echo "status of a killed run: $out"

"$duet" run -p "Hi" -n 2 --instance "$name" -t 1 >/dev/null 2>&1 || fail "a new run did not replace the stale segments"
if seg_exists "duet.$name"; then fail "a clean exit should remove the segments"; fi
echo "stale segments replaced: ok"

bench=$("$duet" bench shm --quick --json) || fail "bench shm"
python3 - <<PY || fail "bench JSON: $bench"
import json
b = json.loads('''$bench''')
figs = {k: v for k, v in b.items() if isinstance(v, dict) and "duet" in v}
assert len(figs) >= 15, sorted(b)
for k, v in figs.items():
    assert v["duet"] > 0 and v["boost"] > 0, (k, v)
for k in ("ring_proc_msgs_per_s", "ring_proc_batch32_msgs_per_s", "ring_proc_rtt_p50_ns",
          "doorbell_wake_p50_ns", "doorbell_wake_p99_ns", "arena_pair_p50_ns", "arena_proc_pairs_per_s"):
    assert k in figs, (k, sorted(figs))
PY
echo "bench shm --quick --json: ok"
