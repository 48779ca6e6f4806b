#!/usr/bin/env bash
# kv-test-labels: net
# `kvasir ring --allow-sparse`: a ring window opens a sliced skeleton (a
# sparse manifest: pieces without hashes, holes read as zeros) only when
# asked, as `run` and `worker` do. The model is a small qwen3moe with holes
# punched in expert tensors of both windows' layers (what `gen-model
# --skeleton` writes at full size), sliced: its manifest is sparse.
#   - without the flag a node refuses the window with one line naming
#     --allow-sparse, and exits;
#   - with it, a 2-node ring (layers 0-1, 2-3) decodes the tokens of
#     `kvasir run -m DIR --allow-sparse`, byte for byte; so does the same
#     ring with the second window's experts on a `kvasir worker
#     --allow-sparse` (the ring node holds backbone and manifest only);
#   - --allow-sparse on a GGUF file (no manifest) is refused.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
dir=$(mktemp -d -t kvasir-ringsparse.XXXXXX)
. "$SRC/tests/ring_support.sh"
trap ring_cleanup EXIT
ring_keys
P="A skeleton's window is served only when asked"
N=10

m="$dir/m.gguf"
"$KV" gen-model --arch qwen3moe --out "$m" --layers 4 --embd 64 --ff-exp 128 --experts 8 --experts-used 2 \
  --heads 4 --kv-heads 2 --head-dim 16 --vocab 600 --type q8_0 --seed 23 >/dev/null 2>&1 || fail "gen-model"
# punch_hole TENSOR: deallocate the whole 4 KiB pages inside TENSOR's data (reads as zeros)
punch_hole() {
  local range
  range=$(python3 - "$m" "$1" <<'EOF'
import struct, sys
f = open(sys.argv[1], "rb"); b = f.read(); f.close()
o = 0
def rd(fmt):
    global o
    v = struct.unpack_from("<" + fmt, b, o); o += struct.calcsize("<" + fmt); return v[0]
def rstr():
    global o
    n = rd("Q"); s = b[o:o + n]; o += n; return s.decode()
SZ = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
def rval(t):
    if t == 8: return rstr()
    if t == 9:
        et = rd("I"); n = rd("Q"); return [rval(et) for _ in range(n)]
    return rd(SZ[t])
assert b[:4] == b"GGUF"; o = 4
rd("I"); nt = rd("Q"); nkv = rd("Q")
align = 32
for _ in range(nkv):
    k = rstr(); v = rval(rd("I"))
    if k == "general.alignment": align = v
ts = []
for _ in range(nt):
    name = rstr(); nd = rd("I"); [rd("Q") for _ in range(nd)]; rd("I"); ts.append((rd("Q"), name))
base = (o + align - 1) // align * align
ts.sort()
for i, (off, name) in enumerate(ts):
    if name == sys.argv[2]:
        end = ts[i + 1][0] if i + 1 < len(ts) else len(b) - base
        a = (base + off + 4095) // 4096 * 4096; e = (base + end) // 4096 * 4096
        assert e - a >= 8192, "tensor too small for a hole"
        print(a, e - a)
EOF
  ) || fail "no offsets for $1"
  read -r off len <<<"$range"
  fallocate -p -o "$off" -l "$len" "$m" || fail "fallocate -p (a filesystem without holes?)"
}
punch_hole blk.1.ffn_up_exps.weight
punch_hole blk.3.ffn_gate_exps.weight
sl="$dir/sl"
"$KV" slice "$m" --out "$sl" --experts-per-slab 4 >/dev/null 2>&1 || fail "slice"
[ "$(jq .sparse "$sl/manifest.json")" = true ] || fail "the punched model did not slice sparse"
"$KV" run -m "$sl" --allow-sparse -p "$P" -n $N --temp 0 --json --threads 1 >"$dir/ref.json" ||
  fail "run -m DIR --allow-sparse"
ref=$(jq -c .tokens "$dir/ref.json")
[ "$(jq '.tokens | length' "$dir/ref.json")" = $N ] || fail "the reference decoded $(jq -c .tokens "$dir/ref.json")"

# 1. without the flag: refused at open, one line naming the flag
read -r -a ports <<<"$(free_ports 2)"
set +e
timeout 30 "$KV" ring -m "$sl/manifest.json" --layers 0-1 --listen "127.0.0.1:${ports[0]}" \
  --next "127.0.0.1:${ports[1]}" --threads 1 --key "$dir/k0.key" --allow-key "$dir/allow" >"$dir/no.out" 2>"$dir/no.err"
rc=$?
set -e
[ $rc != 0 ] && [ $rc != 124 ] || fail "a sparse window without --allow-sparse: exit $rc"
grep -q -- "--allow-sparse" "$dir/no.err" && grep -q "sparse skeleton" "$dir/no.err" ||
  fail "the refusal does not name --allow-sparse: $(cat "$dir/no.err")"
[ "$(wc -l <"$dir/no.err")" = 1 ] || fail "the refusal is not one line: $(cat "$dir/no.err")"
! grep -q "^listening on" "$dir/no.out" || fail "the refused node listened"
echo "without --allow-sparse: $(cat "$dir/no.err")"

# 2. --allow-sparse on a GGUF file: refused (only a manifest describes a skeleton's pieces)
set +e
timeout 30 "$KV" ring -m "$m" --layers 0-1 --listen "127.0.0.1:${ports[0]}" --next "127.0.0.1:${ports[1]}" \
  --threads 1 --allow-sparse --open >/dev/null 2>"$dir/gg.err"
rc=$?
set -e
[ $rc != 0 ] && [ $rc != 124 ] && grep -q "sliced model" "$dir/gg.err" ||
  fail "--allow-sparse on a GGUF file: exit $rc, $(cat "$dir/gg.err")"

# 3. the 2-node ring with --allow-sparse: the reference's tokens, asked through either node
RING_EXTRA="--allow-sparse" ring_start "$sl/manifest.json" 0-1 2-3
for i in 0 1; do
  "$KV" run --ring "${RING_ADDR[$i]}" "${RK[@]}" -p "$P" -n $N --temp 0 --json >"$dir/r$i.json" ||
    fail "the sparse ring failed via node $i: $(cat "$dir/ring0.err" "$dir/ring1.err")"
  [ "$(jq -c .tokens "$dir/r$i.json")" = "$ref" ] ||
    fail "ring via node $i: $(jq -c .tokens "$dir/r$i.json"), run --allow-sparse: $ref"
done
echo "2-node sparse ring: $ref (= run -m DIR --allow-sparse)"
ring_stop

# 4. the second window's experts on a worker serving the sparse slabs
w1="$dir/w1"
mkdir -p "$w1"
cp --sparse=always "$sl/backbone.gguf" "$sl/manifest.json" "$w1/"
slabs=$(ls "$sl"/experts/blk.2.* "$sl"/experts/blk.3.* | paste -sd,)
"$KV" worker --slabs "$slabs" --listen 127.0.0.1:0 --threads 1 --quiet --allow-sparse --allow-key "$dir/allow" \
  >"$dir/wk.out" 2>"$dir/wk.err" &
RING_ALL+=($!)
waddr=
for _ in $(seq 200); do
  waddr=$(sed -n 's/^listening on \(.*\)$/\1/p' "$dir/wk.out" 2>/dev/null | head -1 || true)
  [ -n "$waddr" ] && break
  sleep 0.05
done
[ -n "$waddr" ] || fail "worker did not start: $(cat "$dir/wk.err")"
sparse_nodes() {
  ring_node 0 "$sl/manifest.json" 0-1 "$(ring_at 0)" "$(ring_at 1)" --allow-sparse
  ring_node 1 "$w1/manifest.json" 2-3 "$(ring_at 1)" "$(ring_at 0)" --allow-sparse --worker "$waddr"
}
ring_form 2 sparse_nodes
"$KV" run --ring "${RING_ADDR[0]}" "${RK[@]}" -p "$P" -n $N --temp 0 --json >"$dir/rw.json" ||
  fail "the sparse ring over a worker failed: $(cat "$dir/ring1.err")"
[ "$(jq -c .tokens "$dir/rw.json")" = "$ref" ] || fail "ring over a worker: $(jq -c .tokens "$dir/rw.json"), run: $ref"
echo "sparse ring, window 2-3 on a worker: identical"
echo "PASS"
