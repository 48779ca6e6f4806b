#!/usr/bin/env python3
"""Checks that every TCP stream in pcap files carries only TLS records.

usage: wan_tls_only.py [--want-port PORT]... [--want-conn SRC,DST:PORT]... FILE.pcap...

Reads classic pcap (tcpdump -w; link types RAW, Linux cooked v1/v2,
Ethernet), reassembles each direction of each TCP connection by sequence
number (retransmissions and duplicates merged, first copy kept), and walks
the bytes as TLS records: a 5-byte header (type in {20,21,22,23}, version
0x0303, or 0x0301 on the first record only, as a ClientHello's record may
say, length 1..16640) and its body. The first record of each direction that
carries bytes must be a handshake (22). A direction whose SYN was not
captured, a gap in the bytes, or anything else fails. Prints one JSON line
of counts; exit 0 only when every stream passes and every --want-port was
seen as one end of a stream with payload and every --want-conn (a client
address, a server address and port) as a stream with payload both ways. Python's standard library only.
"""
import json
import struct
import sys

MAX_BODY = 16640  # 2^14 + 256: RFC 8446 section 5.2's TLSCiphertext bound


def packets(path):
    with open(path, "rb") as f:
        hdr = f.read(24)
        if len(hdr) < 24:
            raise SystemExit(f"{path}: not a pcap file (short header)")
        magic = hdr[:4]
        if magic in (b"\xd4\xc3\xb2\xa1", b"\x4d\x3c\xb2\xa1"):
            e = "<"
        elif magic in (b"\xa1\xb2\xc3\xd4", b"\xa1\xb2\x3c\x4d"):
            e = ">"
        else:
            raise SystemExit(f"{path}: not a pcap file (magic {magic.hex()})")
        linktype = struct.unpack(e + "I", hdr[20:24])[0] & 0x0FFFFFFF
        while True:
            rh = f.read(16)
            if not rh:
                return
            if len(rh) < 16:
                raise SystemExit(f"{path}: truncated record header")
            _, _, incl, orig = struct.unpack(e + "IIII", rh)
            if incl > 1 << 20:
                raise SystemExit(f"{path}: record of {incl} bytes")
            data = f.read(incl)
            if len(data) < incl:
                raise SystemExit(f"{path}: truncated record")
            if incl < orig:
                raise SystemExit(f"{path}: a packet cut by the snap length ({incl} of {orig})")
            yield linktype, data


def ipv4_of(linktype, data):
    if linktype in (101, 12, 14):  # RAW
        return data
    if linktype == 113:  # Linux cooked v1
        return data[16:] if struct.unpack(">H", data[14:16])[0] == 0x0800 else None
    if linktype == 276:  # Linux cooked v2
        return data[20:] if struct.unpack(">H", data[0:2])[0] == 0x0800 else None
    if linktype == 1:  # Ethernet
        return data[14:] if struct.unpack(">H", data[12:14])[0] == 0x0800 else None
    raise SystemExit(f"link type {linktype} not handled")


def main(argv):
    want_ports = set()
    want_conns = set()
    files = []
    i = 0
    while i < len(argv):
        if argv[i] == "--want-port":
            want_ports.add(int(argv[i + 1]))
            i += 2
        elif argv[i] == "--want-conn":
            src, dst = argv[i + 1].split(",")
            want_conns.add((src, dst))
            i += 2
        else:
            files.append(argv[i])
            i += 1
    if not files:
        raise SystemExit(__doc__)
    # one direction: (src, sport, dst, dport) -> {isn, segs: {seq: bytes}}
    dirs = {}
    n_pkts = 0
    for path in files:
        for lt, data in packets(path):
            ip = ipv4_of(lt, data)
            if ip is None or len(ip) < 20 or ip[0] >> 4 != 4:
                continue
            ihl = (ip[0] & 15) * 4
            total = struct.unpack(">H", ip[2:4])[0]
            if ip[9] != 6:
                continue
            src, dst = ip[12:16], ip[16:20]
            tcp = ip[ihl:total]
            if len(tcp) < 20:
                continue
            sport, dport, seq = struct.unpack(">HHI", tcp[:8])
            off = (tcp[12] >> 4) * 4
            flags = tcp[13]
            payload = tcp[off:]
            key = (".".join(map(str, src)), sport, ".".join(map(str, dst)), dport)
            # one 4-tuple may carry several connections in turn (the router's
            # masquerade reuses a source port): a SYN with a new sequence
            # number starts a new stream on it
            lst = dirs.setdefault(key, [])
            n_pkts += 1
            if flags & 0x02 and (not lst or lst[-1]["isn"] != seq):
                lst.append({"isn": seq, "segs": {}})
            if not lst:
                lst.append({"isn": None, "segs": {}})
            if payload:
                lst[-1]["segs"].setdefault(seq, payload)
    errors = []
    n_streams = n_records = n_bytes = 0
    ports_seen = set()
    conns_seen = set()
    types = {}
    for key, d in sorted(((k, d) for k, lst in dirs.items() for d in lst), key=lambda t: t[0]):
        if not d["segs"]:
            continue
        name = "%s:%d -> %s:%d" % key
        if d["isn"] is None:
            errors.append(f"{name}: payload without a captured SYN")
            continue
        n_streams += 1
        ports_seen.update((key[1], key[3]))
        conns_seen.add((key[0], "%s:%d" % (key[2], key[3])))
        conns_seen.add((key[2], "%s:%d" % (key[0], key[1])))  # the reply direction: src is the server
        base = (d["isn"] + 1) & 0xFFFFFFFF
        buf = bytearray()
        for seq in sorted(d["segs"], key=lambda s: (s - base) & 0xFFFFFFFF):
            rel = (seq - base) & 0xFFFFFFFF
            seg = d["segs"][seq]
            if rel > len(buf):
                errors.append(f"{name}: a gap of {rel - len(buf)} bytes at offset {len(buf)}")
                break
            if rel + len(seg) > len(buf):
                buf += seg[len(buf) - rel:]
        n_bytes += len(buf)
        pos = 0
        first = True
        while pos < len(buf):
            if len(buf) - pos < 5:
                errors.append(f"{name}: {len(buf) - pos} bytes at the end, not a record header")
                break
            typ, ver, ln = buf[pos], struct.unpack(">H", buf[pos + 1:pos + 3])[0], struct.unpack(
                ">H", buf[pos + 3:pos + 5])[0]
            ok_ver = ver == 0x0303 or (first and ver == 0x0301)
            if typ not in (20, 21, 22, 23) or not ok_ver or not 1 <= ln <= MAX_BODY or (first and typ != 22):
                head = bytes(buf[pos:pos + 16])
                errors.append(f"{name}: offset {pos}: not a TLS record: {head.hex()} {head!r}")
                break
            if pos + 5 + ln > len(buf):
                # the capture ended inside the last record (the process was
                # stopped or killed): what is there is still part of a record
                pass
            types[typ] = types.get(typ, 0) + 1
            n_records += 1
            pos += 5 + ln
            first = False
    missing = sorted(want_ports - ports_seen)
    if missing:
        errors.append(f"no TLS stream on port(s) {missing}")
    for src, dst in sorted(want_conns):
        dip = dst.rsplit(":", 1)[0]
        # both directions: client -> server bytes, and server -> client bytes
        if (src, dst) not in conns_seen or not any(
                k[0] == dip and "%s:%d" % (k[0], k[1]) == dst and k[2] == src and any(d["segs"] for d in lst)
                for k, lst in dirs.items()):
            errors.append(f"no TLS stream from {src} to {dst}")
    print(json.dumps({"packets": n_pkts, "streams": n_streams, "records": n_records, "bytes": n_bytes,
                      "record_types": {str(k): v for k, v in sorted(types.items())}, "errors": errors[:20],
                      "n_errors": len(errors)}))
    return 1 if errors or n_streams == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
