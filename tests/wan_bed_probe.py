#!/usr/bin/env python3
"""TCP probes of the WAN test bed (tests/test_wan_bed.sh, tests/netns_topo.sh),
with the kernel's sockets only, so they see what a real peer would see.

  whoami PORT READY           accept connections until killed; answer each
                              with the peer's address as the server saw it,
                              "IP PORT", and print that line
  ask TIMEOUT HOST:PORT...    connect to each in turn and print a line for
                              each: the server's answer and the connect()
                              time in ms ("IP PORT MS" from whoami), or
                              "error NAME" (ECONNREFUSED, ENETUNREACH,
                              timeout...); one process for many probes, as
                              Python's start costs most of a short test
READY is a file written once the socket listens."""
import errno
import socket
import sys
import time


def main(argv):
    cmd = argv[1]
    if cmd == "whoami":
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", int(argv[2])))
        s.listen(16)
        with open(argv[3], "w") as f:
            f.write("ready\n")
        while True:
            c, peer = s.accept()
            line = "%s %d" % peer
            print(line, flush=True)
            try:
                c.sendall((line + "\n").encode())
            except OSError:
                pass
            c.close()
    elif cmd == "ask":
        for target in argv[3:]:
            host, port = target.rsplit(":", 1)
            t = time.monotonic()
            try:
                c = socket.create_connection((host, int(port)), timeout=float(argv[2]))
                ms = (time.monotonic() - t) * 1000
                answer = b""
                while not answer.endswith(b"\n"):
                    b = c.recv(256)
                    if not b:
                        break
                    answer += b
                c.close()
                print("%s %.3f" % (answer.decode().strip(), ms), flush=True)
            except socket.timeout:
                print("error timeout", flush=True)
            except OSError as e:
                name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else str(e)
                print("error " + name, flush=True)
    else:
        sys.exit("wan_bed_probe: unknown command " + cmd)


if __name__ == "__main__":
    main(sys.argv)
