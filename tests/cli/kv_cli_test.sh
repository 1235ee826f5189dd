#!/usr/bin/env bash
# `duet kv inspect` and `duet kv verify` end to end on the files `kv_gen sample`
# writes (a log of context "demo" compacted once: CHECKPOINT of 5 positions, APPEND
# [5, 8), TRUNCATE to 6, APPEND [6, 7); its checkpoint demo.1.kvblob; export.kvblob,
# positions [0, 5) of a 2-layer, 2-head, 8-dim f16 layout): valid files, a torn
# tail, a flipped byte in a blob, in a checkpoint and mid-log, and a file that is
# not KV at all. The data CRC is recomputed here bit by bit from the polynomial.
# Usage: kv_cli_test.sh path/to/duet path/to/kv_gen
set -euo pipefail
duet=$1
gen=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
# Flips every bit of the byte at offset $2 of file $1.
flip() { python3 -c 'import sys; p, o = sys.argv[1], int(sys.argv[2]); b = bytearray(open(p, "rb").read()); b[o] ^= 0xff; open(p, "wb").write(b)' "$1" "$2"; }

"$gen" sample "$dir/ok" || fail "kv_gen sample"
blob=$dir/ok/export.kvblob
log=$dir/ok/demo.kvlog

# --- a valid blob
out=$("$duet" kv inspect "$blob") || fail "inspect of a valid blob exited $?: $out"
grep -q '^valid$' <<<"$out" || fail "blob not reported valid: $out"
grep -Eq 'model +101112131415161718191a1b1c1d1e1f$' <<<"$out" || fail "model fingerprint: $out"
grep -Eq 'tokenizer +a0a1a2a3a4a5a6a7a8a9aaabacadaeaf$' <<<"$out" || fail "tokenizer fingerprint: $out"
grep -Eq 'n_tokens +5 \(positions \[0, 5\)\)' <<<"$out" || fail "n_tokens: $out"
grep -Eq 'data_crc +0x[0-9a-f]{8} \(verifies\)' <<<"$out" || fail "data_crc: $out"
json=$("$duet" kv inspect --json "$blob") || fail "inspect --json of a valid blob"
python3 - "$blob" <<PY || fail "blob JSON: $json"
import json, sys
def crc32c(b):
    c = 0xffffffff
    for x in b:
        c ^= x
        for _ in range(8):
            c = (c >> 1) ^ (0x82f63b78 if c & 1 else 0)
    return c ^ 0xffffffff
j = json.loads('''$json''')
h = j["header"]
assert j["kind"] == "blob" and j["valid"] and j["data_crc_ok"] and "error" not in j, j
assert h["version"] == 1 and h["first_pos"] == 0 and h["n_tokens"] == 5, h
assert h["layout"] == {"n_layer": 2, "n_head_kv": 2, "head_dim": 8, "dtype": "f16", "block_tokens": 4}, h
# 5 token ids, then 2 layers x K|V x 2 heads x 5 tokens x 8 dims of f16
assert h["data_bytes"] == 5 * 4 + 2 * 2 * 2 * 5 * 8 * 2, h
data = open(sys.argv[1], "rb").read()
assert len(data) == 128 + h["data_bytes"]
assert int(h["data_crc"], 16) == crc32c(data[128:]), (h["data_crc"], hex(crc32c(data[128:])))
assert int.from_bytes(data[128:132], "little") == 11  # kv_gen's token of position 0
PY
echo "inspect of a valid blob: ok"

# --- a valid log
out=$("$duet" kv inspect "$log") || fail "inspect of a valid log exited $?: $out"
grep -q '^valid$' <<<"$out" || fail "log not reported valid: $out"
grep -Eq 'final length +7 positions' <<<"$out" || fail "final length: $out"
grep -Eq 'torn tail +none' <<<"$out" || fail "torn tail: $out"
grep -Eq 'CHECKPOINT .* 5 positions from demo\.1\.kvblob$' <<<"$out" || fail "checkpoint record: $out"
grep -Eq 'TRUNCATE .* new length 6$' <<<"$out" || fail "truncate record: $out"
json=$("$duet" kv inspect --json "$log") || fail "inspect --json of a valid log"
python3 - "$log" <<PY || fail "log JSON: $json"
import json, os, sys
j = json.loads('''$json''')
h, r = j["header"], j["records"]
assert j["kind"] == "log" and j["valid"] and not j["torn"] and "torn_at" not in j, j
assert h["context"] == "demo" and h["generation"] == 1 and h["version"] == 3, h
assert h["layout"]["dtype"] == "f16" and h["layout"]["block_tokens"] == 4, h
assert [x["type"] for x in r] == ["CHECKPOINT", "APPEND", "TRUNCATE", "APPEND"], r
assert r[0]["n_tokens"] == 5 and r[0]["blob"] == "demo.1.kvblob", r[0]
assert (r[1]["start"], r[1]["n"]) == (5, 3) and r[2]["new_length"] == 6 and (r[3]["start"], r[3]["n"]) == (6, 1), r
assert [x["seq"] for x in r] == [0, 1, 2, 3], r
# records follow the 192-byte header (version 3; KVLOG.md) and each other: 48-byte
# header, payload, zero padding to 8 bytes
off = 192
for x in r:
    assert x["offset"] == off, (x, off)
    off += 48 + x["payload_bytes"] + (-x["payload_bytes"] % 8)
assert r[1]["payload_bytes"] == 16 + 3 * 4 + 3 * 2 * 2 * 2 * 8 * 2, r[1]
assert r[3]["payload_bytes"] % 8 == 4, r[3]  # the padding test below cuts 2 of its 4 bytes
assert j["n_tokens"] == 7 and j["valid_end"] == off == j["file_size"] == os.path.getsize(sys.argv[1]), j
open("$dir/last_offset", "w").write(str(r[3]["offset"]))
PY
last=$(cat "$dir/last_offset")
echo "inspect of a valid log: ok"

out=$("$duet" kv verify "$dir/ok") || fail "verify of valid files exited $?: $out"
[ "$(grep -c ': ok' <<<"$out")" = 3 ] || fail "verify: expected 3 ok lines: $out"
grep -q '3 file(s): 3 ok, 0 with a torn tail, 0 invalid' <<<"$out" || fail "verify summary: $out"
echo "verify of valid files: ok"

# --- a torn tail: the last record (APPEND [6, 7)) cut short by 10 bytes
cp -r "$dir/ok" "$dir/torn"
truncate -s -10 "$dir/torn/demo.kvlog"
out=$("$duet" kv inspect "$dir/torn/demo.kvlog") || fail "a torn tail is valid, inspect exited $?: $out"
grep -q "^valid, with a torn tail to cut at offset $last " <<<"$out" || fail "torn tail message: $out"
grep -Eq 'final length +6 positions' <<<"$out" || fail "length before the torn record: $out"
json=$("$duet" kv inspect --json "$dir/torn/demo.kvlog") || fail "inspect --json of a torn tail"
python3 -c 'import json, sys; j = json.loads(sys.argv[1]); assert j["valid"] and j["torn"] and j["torn_at"] == int(sys.argv[2]) and j["n_tokens"] == 6 and len(j["records"]) == 3 and "cut short" in j["torn_reason"], j' "$json" "$last" || fail "torn JSON: $json"
out=$("$duet" kv verify "$dir/torn") || fail "verify of a torn tail exited $?: $out"
grep -q "demo.kvlog: torn tail at $last (" <<<"$out" || fail "verify torn line: $out"
echo "torn tail: ok"

# --- only the last record's padding cut short (2 of its 4 bytes): that record is
# torn too (never acknowledged; keeping it would misplace the next append)
cp -r "$dir/ok" "$dir/pad"
truncate -s -2 "$dir/pad/demo.kvlog"
out=$("$duet" kv inspect "$dir/pad/demo.kvlog") || fail "cut padding is a torn tail, inspect exited $?: $out"
grep -q "^valid, with a torn tail to cut at offset $last " <<<"$out" || fail "cut padding message: $out"
grep -q "padding cut short" <<<"$out" || fail "cut padding reason: $out"
grep -Eq 'final length +6 positions' <<<"$out" || fail "cut padding: the record is not kept: $out"
echo "cut padding: ok"

# --- a flipped byte in the blob's data
cp -r "$dir/ok" "$dir/badblob"
flip "$dir/badblob/export.kvblob" 300
if out=$("$duet" kv inspect "$dir/badblob/export.kvblob"); then fail "inspect accepted a corrupt blob: $out"; fi
grep -q '^INVALID: data_crc: stored' <<<"$out" || fail "corrupt blob message: $out"
grep -Eq 'data_crc +0x[0-9a-f]{8} \(does NOT verify\)' <<<"$out" || fail "corrupt blob data_crc line: $out"
if json=$("$duet" kv inspect --json "$dir/badblob/export.kvblob"); then fail "inspect --json accepted a corrupt blob"; fi
python3 -c 'import json, sys; j = json.loads(sys.argv[1]); assert not j["valid"] and not j["data_crc_ok"] and j["error"].startswith("data_crc"), j' "$json" || fail "corrupt blob JSON: $json"
if out=$("$duet" kv verify "$dir/badblob" 2>"$dir/err"); then fail "verify accepted a corrupt blob: $out"; fi
grep -q 'export.kvblob: INVALID: data_crc' <<<"$out" || fail "verify line of a corrupt blob: $out"
grep -q "invalid: .*badblob/export.kvblob" "$dir/err" || fail "verify did not name the corrupt file: $(cat "$dir/err")"
[ "$(grep -c ': ok' <<<"$out")" = 2 ] || fail "the other files are fine: $out"
echo "corrupt blob: ok"

# --- a flipped byte in a blob's header
cp "$blob" "$dir/hdr.kvblob"
flip "$dir/hdr.kvblob" 50
if out=$("$duet" kv inspect "$dir/hdr.kvblob"); then fail "inspect accepted a corrupt header: $out"; fi
grep -q '^INVALID: header_crc' <<<"$out" || fail "corrupt header message: $out"
echo "corrupt blob header: ok"

# --- the checkpoint a log names is corrupt: both are invalid
cp -r "$dir/ok" "$dir/badckpt"
flip "$dir/badckpt/demo.1.kvblob" 200
if out=$("$duet" kv verify "$dir/badckpt" 2>/dev/null); then fail "verify accepted a corrupt checkpoint: $out"; fi
grep -q 'demo.1.kvblob: INVALID: data_crc' <<<"$out" || fail "checkpoint line: $out"
grep -q 'demo.kvlog: INVALID: .*checkpoint' <<<"$out" || fail "log line of a corrupt checkpoint: $out"
echo "corrupt checkpoint: ok"

# --- mid-log corruption: a byte of the first APPEND's payload, later commits intact
cp -r "$dir/ok" "$dir/midlog"
append_off=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["records"][1]["offset"])' "$("$duet" kv inspect --json "$log")")
flip "$dir/midlog/demo.kvlog" $((append_off + 48 + 40))
if out=$("$duet" kv inspect "$dir/midlog/demo.kvlog"); then fail "inspect accepted mid-log corruption: $out"; fi
grep -q '^INVALID: .*mid-log corruption' <<<"$out" || fail "mid-log message: $out"
grep -Eq 'context +demo$' <<<"$out" || fail "the header is still shown: $out"
if out=$("$duet" kv verify "$dir/midlog" 2>/dev/null); then fail "verify accepted mid-log corruption: $out"; fi
grep -q 'demo.kvlog: INVALID: .*mid-log corruption' <<<"$out" || fail "verify mid-log line: $out"
echo "mid-log corruption: ok"

# --- not KV files; a missing directory
mkdir -p "$dir/junk/sub"
echo "hello, world" >"$dir/junk/sub/x.kvlog"
if out=$("$duet" kv inspect "$dir/junk/sub/x.kvlog"); then fail "inspect accepted a text file: $out"; fi
grep -q 'INVALID: not a duet KV file' <<<"$out" || fail "text file message: $out"
if out=$("$duet" kv verify "$dir/junk" 2>/dev/null); then fail "verify accepted a text file: $out"; fi
grep -q 'sub/x.kvlog: INVALID: .*truncated header' <<<"$out" || fail "verify of a text file, found recursively: $out"
if "$duet" kv verify "$dir/no-such-dir" 2>"$dir/err"; then fail "verify of a missing directory succeeded"; fi
grep -q 'no-such-dir' "$dir/err" || fail "missing directory message: $(cat "$dir/err")"
echo "not KV files: ok"
