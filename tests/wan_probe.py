#!/usr/bin/env python3
"""Probes of a link between two network namespaces (tests/test_netdelay.sh),
written with the kernel's sockets only, so they measure what the kernel TCP
and UDP stacks see.

  sink PORT READY            accept one TCP connection, read to EOF, answer
                             with the SHA-256 (hex) and length of what came
  send HOST PORT FILE        send FILE to a sink, wait for its answer; print
                             "SHA256 LEN SECONDS" (seconds: connect to answer)
  accept PORT N READY        accept and close N TCP connections
  connect HOST PORT N        N TCP connects; print each connect()'s ms
  udp-sink PORT READY IDLE   count UDP datagrams until none came for IDLE s
  udp-burst HOST PORT N      send N 1000-byte datagrams back to back
READY is a file written once the socket listens."""
import hashlib
import socket
import sys
import time


def listen(port, kind=socket.SOCK_STREAM):
    s = socket.socket(socket.AF_INET, kind)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    if kind == socket.SOCK_STREAM:
        s.listen(16)
    return s


def ready(path):
    with open(path, "w") as f:
        f.write("ready\n")


def main(argv):
    cmd = argv[1]
    if cmd == "sink":
        s = listen(int(argv[2]))
        ready(argv[3])
        c, _ = s.accept()
        h, n = hashlib.sha256(), 0
        while True:
            b = c.recv(1 << 16)
            if not b:
                break
            h.update(b)
            n += len(b)
        c.sendall(("%s %d\n" % (h.hexdigest(), n)).encode())
        c.close()
    elif cmd == "send":
        data = open(argv[4], "rb").read()
        t = time.monotonic()
        c = socket.create_connection((argv[2], int(argv[3])), timeout=30)
        c.sendall(data)
        c.shutdown(socket.SHUT_WR)
        answer = b""
        while not answer.endswith(b"\n"):
            b = c.recv(256)
            if not b:
                break
            answer += b
        print(answer.decode().strip(), "%.4f" % (time.monotonic() - t))
    elif cmd == "accept":
        s = listen(int(argv[2]))
        ready(argv[4])
        for _ in range(int(argv[3])):
            c, _ = s.accept()
            c.close()
    elif cmd == "connect":
        for _ in range(int(argv[4])):
            c = socket.socket()
            t = time.monotonic()
            c.connect((argv[2], int(argv[3])))
            print("%.3f" % ((time.monotonic() - t) * 1000))
            c.close()
    elif cmd == "udp-sink":
        s = listen(int(argv[2]), socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
        ready(argv[3])
        s.settimeout(10)  # the first datagram
        n = 0
        try:
            while True:
                s.recv(2048)
                n += 1
                s.settimeout(float(argv[4]))
        except socket.timeout:
            pass
        print(n)
    elif cmd == "udp-burst":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        payload = b"k" * 1000
        for _ in range(int(argv[4])):
            s.sendto(payload, (argv[2], int(argv[3])))
    else:
        sys.exit("wan_probe: unknown command " + cmd)


if __name__ == "__main__":
    main(sys.argv)
