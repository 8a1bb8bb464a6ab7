"""Bounded servers, measured (`make probe-bounded`): a real kt-metadata and
kt-store (release binaries) on loopback, then

1. slow bodies: N connections (default 600) each send a put's headers and
   a few bytes of a body they never finish; meanwhile /healthz is timed 200
   times; prints its p50/p99/max;
2. large bodies: 4 concurrent put plans of SIZE MiB (default 200), and 4 of
   60 MiB, each sent in full; prints the store's peak RSS growth (VmHWM)
   and what each request was answered.

Prints figures only; exits non-zero when the servers do not start. Traffic
goes to 127.0.0.1 only.

usage: python3 bounded.py BIN_DIR [--slow N] [--size MiB]
"""

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

TOKEN = "probe-token-0123456789"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url, deadline=30):
    end = time.time() + deadline
    while time.time() < end:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"{url} never became ready")


def rss_kib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def head(port, length):
    return (f"POST /api/v1/puts HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"authorization: Bearer {TOKEN}\r\ncontent-length: {length}\r\n\r\n").encode()


def slow_bodies(port, n):
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(head(port, 1 << 20) + b"abc")
        socks.append(s)
    lat = []
    for _ in range(200):
        t = time.perf_counter()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=30) as r:
            r.read()
        lat.append((time.perf_counter() - t) * 1000)
    for s in socks:
        s.close()
    lat.sort()
    return lat[len(lat) // 2], lat[int(len(lat) * 0.99) - 1], lat[-1]


def large_bodies(port, pid, mib, n=4):
    before = rss_kib(pid, "VmRSS")
    answers = [None] * n
    chunk = b"\0" * (1 << 20)

    def send(i):
        try:
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(head(port, mib << 20))
            for _ in range(mib):
                s.sendall(chunk)
            answers[i] = s.recv(64).split(b"\r\n")[0].decode()
        except OSError as e:
            answers[i] = f"connection: {e.strerror or e}"

    ts = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return before, rss_kib(pid, "VmHWM"), answers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin_dir")
    ap.add_argument("--slow", type=int, default=600)
    ap.add_argument("--size", type=int, default=200)
    a = ap.parse_args()
    env = dict(os.environ, KT_TOKEN=TOKEN, KT_LOG="warn")
    with tempfile.TemporaryDirectory() as d:
        mport, sport = free_port(), free_port()
        meta = subprocess.Popen([f"{a.bin_dir}/kt-metadata", "--listen", f"127.0.0.1:{mport}",
                                 "--state-dir", f"{d}/meta"], env=env)
        store = subprocess.Popen([f"{a.bin_dir}/kt-store", "--listen", f"127.0.0.1:{sport}",
                                  "--data-dir", f"{d}/store", "--metadata-url",
                                  f"http://127.0.0.1:{mport}"], env=env)
        try:
            wait_ready(f"http://127.0.0.1:{mport}")
            wait_ready(f"http://127.0.0.1:{sport}")
            p50, p99, worst = slow_bodies(sport, a.slow)
            print(f"slow bodies: {a.slow} unfinished put bodies open; /healthz over 200 calls: "
                  f"p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {worst:.1f} ms")
            for mib in (a.size, 60):
                before, peak, answers = large_bodies(sport, store.pid, mib)
                print(f"large bodies: 4 x {mib} MiB put plans at once: store RSS {before // 1024} MiB "
                      f"before, peak {peak // 1024} MiB (+{(peak - before) // 1024} MiB); answers: "
                      + "; ".join(sorted(set(answers))))
        finally:
            for p in (store, meta):
                p.terminate()
                p.wait(timeout=20)


if __name__ == "__main__":
    sys.exit(main())
