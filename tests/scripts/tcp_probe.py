"""TCP round-trip time and throughput between two network namespaces (no MPI).

    tcp_probe.py serve ADDR PORT               # echoes 1-byte pings, then swallows a bulk stream,
                                               # prints "steady_mbit_s X" (rate past the first quarter)
    tcp_probe.py measure ADDR PORT PINGS MB    # prints "rtt_ms min median" and "mbit_s X"
"""
import socket
import statistics
import sys
import time


def serve(addr, port):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((addr, port))
    ls.listen(1)
    print("ready", flush=True)
    ls.settimeout(30)
    s, _ = ls.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:                      # ping phase: echo until the client sends b"B"
        b = s.recv(1)
        if not b or b == b"B":
            break
        s.sendall(b)
    marks = []                       # bulk phase: (time, bytes so far) per received chunk
    total = 0
    while True:
        chunk = s.recv(1 << 20)
        if not chunk:
            break
        total += len(chunk)
        marks.append((time.perf_counter(), total))
    s.close()
    if len(marks) > 4:
        # the rate past the first quarter of the bytes: TCP's slow start left out
        t0, b0 = next(m for m in marks if m[1] >= total / 4)
        print("steady_mbit_s %.1f" % ((total - b0) * 8 / (marks[-1][0] - t0) / 1e6), flush=True)


def measure(addr, port, pings, mb):
    s = socket.create_connection((addr, port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(pings):
        t0 = time.perf_counter()
        s.sendall(b"p")
        if s.recv(1) != b"p":
            raise SystemExit("echo lost")
        rtts.append((time.perf_counter() - t0) * 1e3)
    print("rtt_ms %.2f %.2f" % (min(rtts), statistics.median(rtts)), flush=True)
    s.sendall(b"B")
    payload = b"\0" * (1 << 20)
    nbytes = int(mb * 1e6)
    t0 = time.perf_counter()
    sent = 0
    while sent < nbytes:
        sent += s.send(payload[:min(len(payload), nbytes - sent)])
    s.shutdown(socket.SHUT_WR)
    s.recv(1)                        # returns b"" once the server has read everything and closed
    dt = time.perf_counter() - t0
    print("mbit_s %.1f" % (sent * 8 / dt / 1e6), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        measure(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
