#!/usr/bin/env bash
# kv-test-labels: oracle net
# Split GGUF files (NAME-00001-of-0000N.gguf, llama.cpp's gguf-split layout)
# as published, and types no backend computes, end to end through the CLI:
#  1. a generated model written as 3 parts by `kvasir gguf-split`, given by its
#     first or its last part: `run` gives the tokens and the logits
#     (byte-identical) of the one-file model; `inspect` shows the 3 parts and
#     the same tensors and bytes; `slice` gives pieces equal byte for byte to
#     the one-file model's but for the model identity they carry, which run
#     to the same tokens; parts cut by --split-max-size run the same too; a
#     gateway over part 2 completes greedily to the one-file run's text, under
#     the model's name (the part's without -00002-of-00003);
#  2. llama.cpp (node-llama-cpp, the test-only oracle) loads the same 3 parts
#     from the first and generates the same greedy tokens;
#  3. a set with a part missing: run, inspect and slice fail, naming the part;
#     a tensor in none of the parts is named as such;
#  4. an expert tensor whose type id is patched to i16 (which no backend
#     computes): run, a sliced run, a run of it split, and the gateway are
#     refused at load, naming the tensor; inspect names it.
# A missing oracle is a FAILURE, not a skip (tools/install-oracle.sh).
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
BIN=${KV_BIN:-$SRC/build/kvasir}
fail() { echo "test_split_model: FAIL: $*" >&2; exit 1; }
command -v node >/dev/null 2>&1 || fail "node not found (the llama.cpp oracle needs Node.js >= 20)"
command -v python3 >/dev/null 2>&1 || fail "python3 not found"
PJ="$SRC/tests/oracle/node_modules/node-llama-cpp/package.json"
[ -f "$PJ" ] || fail "oracle missing: $PJ (run tools/install-oracle.sh)"
[ -x "$BIN" ] || fail "kvasir binary missing: $BIN"
export NODE_LLAMA_CPP_SKIP_DOWNLOAD=true
DIR=$(mktemp -d "${TMPDIR:-/tmp}/kv_split.XXXXXX")
GW=
cleanup() { [ -n "$GW" ] && kill "$GW" 2>/dev/null; wait 2>/dev/null; rm -rf "$DIR"; }
trap cleanup EXIT
PROMPT="The quick brown fox jumps over"
N=16

"$BIN" gen-model --preset tiny --out "$DIR/m.gguf" >/dev/null 2>&1 || fail "gen-model"
"$BIN" gguf-split --split 3 "$DIR/m.gguf" "$DIR/s" >/dev/null || fail "gguf-split --split 3"
for k in 1 2 3; do [ -f "$DIR/s-0000$k-of-00003.gguf" ] || fail "part $k not written"; done
[ -e "$DIR/s-00004-of-00003.gguf" ] && fail "a fourth part was written"

# ---- 1. run, inspect, slice -------------------------------------------
run() { "$BIN" run -m "$1" -p "$PROMPT" -n $N --temp 0 --threads 2 --json --logits-out "$2"; }
tokens() { python3 -c 'import json,sys; print(",".join(map(str, json.load(sys.stdin)["tokens"])))'; }
ptokens() { python3 -c 'import json,sys; print(",".join(map(str, json.load(sys.stdin)["prompt_tokens"])))'; }
REF=$(run "$DIR/m.gguf" "$DIR/m.logits") || fail "run of the one-file model"
want=$(echo "$REF" | tokens)
prompt_ids=$(echo "$REF" | ptokens)
[ "$(echo "$want" | tr ',' '\n' | wc -l)" -eq $N ] || fail "the one-file run gave no $N tokens: $want"
for part in 1 3; do
  got=$(run "$DIR/s-0000$part-of-00003.gguf" "$DIR/s$part.logits" | tokens) || fail "run of part $part"
  [ "$got" = "$want" ] || fail "split model (given part $part): tokens $got, one file: $want"
  cmp -s "$DIR/m.logits" "$DIR/s$part.logits" || fail "split model (given part $part): logits differ from the one file's"
done

"$BIN" inspect "$DIR/s-00002-of-00003.gguf" >"$DIR/inspect.txt" || fail "inspect of part 2"
grep -q "^split         3 parts" "$DIR/inspect.txt" || fail "inspect does not show the 3 parts: $(head -5 "$DIR/inspect.txt")"
"$BIN" inspect --json "$DIR/m.gguf" >"$DIR/m.json" || fail "inspect --json"
"$BIN" inspect --json "$DIR/s-00001-of-00003.gguf" >"$DIR/s.json" || fail "inspect --json of the split"
python3 - "$DIR/m.json" "$DIR/s.json" "$DIR" <<'EOF' || fail "inspect of the split model disagrees with the one file's"
import json, os, sys
m, s = (json.load(open(p)) for p in sys.argv[1:3])
d = sys.argv[3]
assert len(s["parts"]) == 3, s.get("parts")
for k in ("n_tensors", "tensor_bytes", "classes", "types", "layers", "experts"):
    assert m[k] == s[k], k
sizes = [os.path.getsize(f"{d}/s-0000{k}-of-00003.gguf") for k in (1, 2, 3)]
assert [p["file_bytes"] for p in s["parts"]] == sizes, sizes
assert s["file_bytes"] == sum(sizes)
assert sum(p["tensors"] for p in s["parts"]) == m["n_tensors"]
assert sum(p["tensor_bytes"] for p in s["parts"]) == m["tensor_bytes"]
EOF

"$BIN" slice "$DIR/m.gguf" --out "$DIR/sl1" >/dev/null || fail "slice of the one-file model"
"$BIN" slice "$DIR/s-00003-of-00003.gguf" --out "$DIR/sl3" >/dev/null || fail "slice of the split model"
python3 - "$DIR/sl1" "$DIR/sl3" <<'EOF' || fail "the split model's slices differ from the one file's"
import json, sys
a, b = sys.argv[1:3]
ma, mb = (json.load(open(f"{p}/manifest.json")) for p in (a, b))
ida, idb = ma["model"]["id"], mb["model"]["id"]
assert ida != idb, "a split model has its own identity"
files = ["backbone.gguf"] + [s["path"] for s in ma["slabs"]]
assert files == ["backbone.gguf"] + [s["path"] for s in mb["slabs"]]
for f in files:
    x, y = open(f"{a}/{f}", "rb").read(), open(f"{b}/{f}", "rb").read()
    # every byte equal but the identity each piece carries (kvasir.source.id)
    assert x.count(ida.encode()) == 1 and y.count(idb.encode()) == 1, f
    assert x.replace(ida.encode(), idb.encode()) == y, f
    assert b"split.count" not in y, f
EOF
got=$(run "$DIR/sl3" "$DIR/sl3.logits" | tokens) || fail "run from the split model's slices"
[ "$got" = "$want" ] || fail "from the split model's slices: tokens $got, one file: $want"

"$BIN" gguf-split --split-max-size 3M "$DIR/m.gguf" "$DIR/z" >"$DIR/z.txt" || fail "gguf-split --split-max-size"
nz=$(ls "$DIR"/z-0000*-of-*.gguf | wc -l)
[ "$nz" -ge 3 ] || fail "--split-max-size 3M of a 9 MB model wrote $nz parts"
for f in "$DIR"/z-*.gguf; do # 3 MB of tensor data at most (no tensor here is larger), plus a header < 100 kB
  [ "$(stat -c %s "$f")" -le 3100000 ] || fail "a part of --split-max-size 3M has $(stat -c %s "$f") bytes: $f"
done
got=$(run "$(ls "$DIR"/z-00002-of-*.gguf)" "$DIR/z.logits" | tokens) || fail "run of the --split-max-size parts"
[ "$got" = "$want" ] || fail "--split-max-size parts: tokens $got, one file: $want"

# the gateway serves the split model
"$BIN" gateway -m "$DIR/s-00002-of-00003.gguf" --listen 127.0.0.1:0 --threads 2 >"$DIR/gw.out" 2>"$DIR/gw.err" &
GW=$!
for _ in $(seq 1 600); do
  grep -q "^listening on " "$DIR/gw.out" 2>/dev/null && break
  kill -0 "$GW" 2>/dev/null || fail "gateway over the split model exited: $(cat "$DIR/gw.err")"
  sleep 0.1
done
ADDR=$(sed -n 's/^listening on //p' "$DIR/gw.out")
[ -n "$ADDR" ] || fail "gateway did not print its address"
echo "$REF" >"$DIR/ref.json"
python3 - "$ADDR" "$PROMPT" $N "$DIR/ref.json" <<'EOF' || fail "the gateway over the split model does not complete as the one file runs"
import json, sys, urllib.request
addr, prompt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
want = json.load(open(sys.argv[4]))["text"]
body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0}).encode()
req = urllib.request.Request(f"http://{addr}/v1/completions", body, {"Content-Type": "application/json"})
r = json.load(urllib.request.urlopen(req, timeout=60))
assert r["usage"]["completion_tokens"] == n, r["usage"]
assert r["model"] == "s", r["model"]  # the model's name, not its part's
assert r["choices"][0]["text"] == want, (r["choices"][0]["text"], want)
EOF
kill "$GW" 2>/dev/null || true
wait "$GW" 2>/dev/null || true
GW=

# ---- 2. llama.cpp loads the same parts ----------------------------------
ref=$(node "$SRC/tests/oracle/oracle.mjs" generate "$DIR/s-00001-of-00003.gguf" --ids "$prompt_ids" -n $N --threads 2 \
  | tokens) || fail "llama.cpp cannot load the split model"
[ "$ref" = "$want" ] || fail "llama.cpp on the split model: tokens $ref, ours: $want"

# ---- 3. a part missing ---------------------------------------------------
mkdir "$DIR/miss"
cp "$DIR/s-00001-of-00003.gguf" "$DIR/s-00003-of-00003.gguf" "$DIR/miss/"
for cmd in "run -m X -p hi -n 1" "inspect X" "slice X --out $DIR/miss/out"; do
  set +e
  out=$("$BIN" ${cmd/X/$DIR/miss/s-00001-of-00003.gguf} 2>&1 >/dev/null)
  rc=$?
  set -e
  [ $rc -ne 0 ] || fail "'$cmd' with part 2 missing succeeded"
  echo "$out" | grep -q "part 2 of 3 is missing: $DIR/miss/s-00002-of-00003.gguf" \
    || fail "'$cmd' with part 2 missing: '$out' does not name the part"
done

# a tensor renamed in its part (same length: every offset stays): missing from the model
mkdir "$DIR/ren"
python3 - "$DIR" <<'EOF' || fail "cannot rename a tensor in its part"
import sys
d = sys.argv[1]
hit = 0
for k in (1, 2, 3):
    b = open(f"{d}/s-0000{k}-of-00003.gguf", "rb").read()
    n = b.count(b"blk.1.ffn_down_exps.weight")
    hit += n
    open(f"{d}/ren/s-0000{k}-of-00003.gguf", "wb").write(b.replace(b"blk.1.ffn_down_exps.weight", b"blk.9.ffn_down_exps.weight"))
assert hit == 1, hit
EOF
set +e
out=$("$BIN" run -m "$DIR/ren/s-00002-of-00003.gguf" -p hi -n 1 2>&1 >/dev/null)
rc=$?
set -e
[ $rc -ne 0 ] || fail "a split model without blk.1.ffn_down_exps.weight ran"
echo "$out" | grep -q "missing tensor 'blk.1.ffn_down_exps.weight' (in none of the split model's 3 parts)" \
  || fail "a tensor missing from a split model: '$out'"

# ---- 4. a type no backend computes ---------------------------------------
"$BIN" gen-model --preset tiny --type f16 --out "$DIR/h.gguf" >/dev/null 2>&1 || fail "gen-model --type f16"
python3 - "$DIR/h.gguf" "$DIR/bad.gguf" <<'EOF' || fail "cannot patch the type"
# walks the GGUF header and sets blk.1.ffn_up_exps.weight's type id to
# ggml's I16 (25): 2 bytes per element as f16, so every offset stays valid
import struct, sys
b = bytearray(open(sys.argv[1], "rb").read())
nt, nkv = struct.unpack_from("<QQ", b, 8)
o = 24
size = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
def string(o):
    n = struct.unpack_from("<Q", b, o)[0]
    return b[o + 8:o + 8 + n].decode(), o + 8 + n
def value(t, o):
    if t == 8:
        return string(o)[1]
    if t == 9:
        et, n = struct.unpack_from("<IQ", b, o)
        o += 12
        for _ in range(n):
            o = value(et, o)
        return o
    return o + size[t]
for _ in range(nkv):
    _, o = string(o)
    o = value(struct.unpack_from("<I", b, o)[0], o + 4)
done = False
for _ in range(nt):
    name, o = string(o)
    nd = struct.unpack_from("<I", b, o)[0]
    o += 4 + 8 * nd
    if name == "blk.1.ffn_up_exps.weight":
        assert struct.unpack_from("<I", b, o)[0] == 1  # f16
        struct.pack_into("<I", b, o, 25)
        done = True
    o += 12
assert done
open(sys.argv[2], "wb").write(b)
EOF
expect_refused() { # what, then the command
  local what=$1; shift
  set +e
  out=$("$@" 2>&1 >/dev/null)
  rc=$?
  set -e
  [ $rc -ne 0 ] || fail "$what: an i16 expert tensor was accepted"
  echo "$out" | grep -q "blk.1.ffn_up_exps.weight has type i16\|tensor 'blk.1.ffn_up_exps.weight' has type i16" \
    || fail "$what: '$out' does not name the tensor and its type"
}
expect_refused "run" "$BIN" run -m "$DIR/bad.gguf" -p hi -n 1
"$BIN" inspect "$DIR/bad.gguf" | grep -q "^unsupported   tensor 'blk.1.ffn_up_exps.weight' has type i16 (25)" \
  || fail "inspect does not name the tensor kvasir cannot compute"
"$BIN" slice "$DIR/bad.gguf" --out "$DIR/slbad" >/dev/null || fail "slice of the i16 model"
expect_refused "sliced run" "$BIN" run -m "$DIR/slbad" -p hi -n 1
"$BIN" gguf-split --split 2 "$DIR/bad.gguf" "$DIR/bads" >/dev/null || fail "gguf-split of the i16 model"
expect_refused "split run" "$BIN" run -m "$DIR/bads-00002-of-00002.gguf" -p hi -n 1
# the gateway refuses to start (it would otherwise listen and fail requests)
expect_refused "gateway" timeout 60 "$BIN" gateway -m "$DIR/bad.gguf" --listen 127.0.0.1:0
echo "test_split_model: ok (split run/slice/inspect, llama.cpp on the parts, missing part, i16 refused at load)"
