# Shared by the load-refusal script tests (sourced): test_gateway_unrunnable.sh
# and test_load_refusals.sh. Needs KV (the binary) and fail.

# unrunnable_model OUT: a gen-model F16 model (tiny preset, --ff-exp 256) at OUT.
unrunnable_model() {
  "$KV" gen-model --preset tiny --type f16 --ff-exp 256 --out "$1" >/dev/null 2>&1 || fail "gen-model"
}

# gguf_patch_type FILE TENSOR OLD NEW: rewrites TENSOR's type field in
# FILE's tensor infos from OLD to NEW (F16 1 -> I16 25 keeps two bytes a
# value, so the file stays well-formed). The GGUF header is walked here by
# hand, not by kvasir's reader; non-zero when the tensor is missing or its
# type is not OLD.
gguf_patch_type() {
  python3 - "$1" "$2" "$3" "$4" <<'PY'
import struct, sys
path, want, old, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
b = open(path, 'rb').read(); o = 4
def rd(f, n):
    global o; v = struct.unpack_from(f, b, o)[0]; o += n; return v
def s():
    global o; n = rd('<Q', 8); v = b[o:o + n].decode(); o += n; return v
SZ = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
def val(t):
    global o
    if t == 8: s()
    elif t == 9:
        et = rd('<I', 4); n = rd('<Q', 8)
        for _ in range(n): val(et)
    else: o += SZ[t]
assert b[:4] == b'GGUF'
rd('<I', 4); nt = rd('<Q', 8); nkv = rd('<Q', 8)
for _ in range(nkv): s(); val(rd('<I', 4))
for _ in range(nt):
    name = s(); nd = rd('<I', 4); o += 8 * nd; at = o; ty = rd('<I', 4); rd('<Q', 8)
    if name == want:
        assert ty == old, (name, ty)
        with open(path, 'r+b') as f: f.seek(at); f.write(struct.pack('<I', new))
        sys.exit(0)
sys.exit('no tensor ' + want)
PY
}

# what kvasir says of blk.1.ffn_down_exps.weight patched to I16
UNRUNNABLE_WANT="tensor 'blk.1.ffn_down_exps.weight' has type i16 (25), which kvasir cannot compute"
