#!/usr/bin/env python3
"""A stranger's registrations, written independently of Kvasir's C client:
fresh Ed25519 keys (python3-cryptography) sign POST /v1/register as
docs/HUB.md "Identity and signed requests" describes, each claiming shards of
the hub's own manifest (their real hashes: the bytes are public) at an address
of the attacker's choice. Loopback hubs only.

usage: attack_register.py HUB_URL N ADDR_SPEC SHARDS [SEED]
  ADDR_SPEC  a HOST:PORT for every key, or "spread" (127.0.X.Y:9, many hosts)
  SHARDS     "all", or comma-separated manifest slab indices
Prints one JSON line: {"sent": N, "status": {"200": a, "429": b, ...}}.
"""
import hashlib, json, sys, time, urllib.error, urllib.request
from urllib.parse import urlparse
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives import serialization

def main():
    url, n, spec, shards = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    seed = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    host = urlparse(url).hostname
    assert host.startswith("127."), "loopback hubs only"
    with urllib.request.urlopen(url + "/v1/manifest", timeout=10) as r:
        man = json.load(r)
    slabs = man["slabs"]
    idx = range(len(slabs)) if shards == "all" else [int(x) for x in shards.split(",")]
    held = [{"layer": slabs[i]["layer"], "first": slabs[i]["first"], "last": slabs[i]["last"],
             "sha256": slabs[i]["sha256"]} for i in idx]
    counts = {}
    for k in range(n):
        key = Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"attack-%d-%d" % (seed, k)).digest())
        pk = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()
        with urllib.request.urlopen(url + "/v1/nonce", timeout=10) as r:
            nonce = json.load(r)["nonce"]
        addr = spec if spec != "spread" else "127.0.%d.%d:9" % (1 + k // 250, 2 + k % 250)
        body = json.dumps({"nonce": nonce, "addr": addr, "memory": 1 << 30, "backend": "avx2",
                           "shards": held}, separators=(",", ":")).encode()
        ctr = str(time.time_ns())
        dg = hashlib.sha256(b"kvasir-hub-v1\nPOST\n/v1/register\n" + ctr.encode() + b"\n" +
                            hashlib.sha256(body).hexdigest().encode() + b"\n").digest()
        req = urllib.request.Request(url + "/v1/register", data=body, method="POST", headers={
            "Content-Type": "application/json", "X-Kvasir-Key": pk, "X-Kvasir-Counter": ctr,
            "X-Kvasir-Signature": key.sign(dg).hex()})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                st = r.status
        except urllib.error.HTTPError as e:
            st = e.code
        counts[str(st)] = counts.get(str(st), 0) + 1
    print(json.dumps({"sent": n, "status": counts}))

main()
