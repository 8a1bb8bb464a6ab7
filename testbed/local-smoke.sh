#!/usr/bin/env bash
# The local target, end to end with the real binaries: a metadata server and a
# store on loopback, then put/get/ls/rm through the kt CLI, checking what comes
# back byte for byte. (The YAML scenario runner, kt-scenario, supersedes this.)
set -euo pipefail
BIN=${1:-target/release}
BIN=$(cd "$BIN" && pwd)
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; for f in "$WORK"/*.log; do echo "--- $f"; tail -20 "$f"; done >&2; exit 1; }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { # url
  for _ in $(seq 1 200); do
    if curl -fsS "$1" >/dev/null 2>&1; then return 0; fi
    sleep 0.05
  done
  fail "timed out waiting for $1"
}

export KT_TOKEN=local-smoke-$RANDOM
MP=$(free_port); SP=$(free_port)
export KT_METADATA_URL=http://127.0.0.1:$MP
"$BIN/kt-metadata" --listen 127.0.0.1:$MP --state-dir "$WORK/meta" >"$WORK/metadata.log" 2>&1 & PIDS+=($!)
wait_http "$KT_METADATA_URL/healthz"
"$BIN/kt-store" --listen 127.0.0.1:$SP --data-dir "$WORK/store" --metadata-url "$KT_METADATA_URL" >"$WORK/store.log" 2>&1 & PIDS+=($!)
wait_http "http://127.0.0.1:$SP/readyz"
KT="$BIN/kt --progress never"

step() { printf '%-60s' "$1"; }
ok() { echo ok; }

step "tree round trip (files, empty dir, symlink, unicode)"
mkdir -p "$WORK/src/sub/empty" && echo hello >"$WORK/src/sub/a.txt" && : >"$WORK/src/zero"
printf 'ü' >"$WORK/src/ünï.txt"; ln -s sub/a.txt "$WORK/src/link"
head -c 20000000 /dev/urandom >"$WORK/src/big.bin"
$KT put smoke/tree --src "$WORK/src" >/dev/null || fail "put"
$KT get smoke/tree --dest "$WORK/out" >/dev/null || fail "get"
diff -r --no-dereference "$WORK/src" "$WORK/out" || fail "trees differ"
ok

step "unchanged re-put moves nothing"
$KT put smoke/tree --src "$WORK/src" | grep -q "0 of 4 files sent" || fail "re-put moved data"
ok

step "single file round trip"
$KT put smoke/file --src "$WORK/src/sub/a.txt" >/dev/null || fail "put file"
$KT get smoke/file --dest "$WORK/a-copy.txt" >/dev/null || fail "get file"
cmp "$WORK/src/sub/a.txt" "$WORK/a-copy.txt" || fail "file differs"
ok

step "ls lists the keys"
$KT ls smoke | grep -q tree || fail "ls"
$KT ls smoke -o json | python3 -c 'import json,sys; e=json.load(sys.stdin); assert {x["name"] for x in e}=={"tree","file"}, e' || fail "ls json"
ok

step "bad key, missing key and wrong token fail clearly"
set +e
$KT put 'smoke/../x' --src "$WORK/src" 2>"$WORK/err"; rc=$?
set -e
[ $rc -eq 2 ] && grep -q '".."' "$WORK/err" || fail "bad key: rc=$rc $(cat "$WORK/err")"
set +e; $KT get smoke/none --dest "$WORK/none" 2>/dev/null; rc=$?; set -e
[ $rc -eq 3 ] || fail "missing key: rc=$rc"
set +e; KT_TOKEN=wrong $KT ls 2>/dev/null; rc=$?; set -e
[ $rc -eq 4 ] || fail "wrong token: rc=$rc"
ok

step "rm -r removes keys and data"
$KT rm smoke -r >/dev/null || fail "rm"
[ -z "$($KT ls smoke -o json | python3 -c 'import json,sys; print(json.load(sys.stdin) or "")')" ] || fail "keys left"
ok

echo "local smoke: all steps passed"
