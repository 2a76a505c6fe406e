"""The HTTP side against the wire protocol of the same server, in one run.

    python bench/web.py            # 2,000 creates each way, queries at 100,000 jobs
    python bench/web.py --quick    # 500 creates, queries at 20,000 jobs

Starts `jobserver serve --synchronous FULL --http-port` on a fresh SQLite
file and measures, with one client on each side (plain sockets on the wire,
http.client with keep-alive over HTTP, both one request at a time):

- create: CreateJob on the wire against Jobber's POST /queue, the rate and
  the server's CPU per create (/proc/PID/stat), and their ratio;
- what an operator's looks cost once the queue is large: GET /metrics,
  POST /api/Queues and the dashboard's GET /, the median of five.

Prints a table; nothing is recorded.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from clients import PAYLOAD, JobserverClient
from run import free_port, server_cpu, wait_port
from scale import start_server

ROOT = Path(__file__).resolve().parent.parent


def timed(count: int, one: Callable[[], object], pid: int) -> tuple[float, float]:
    """(requests a second, server CPU microseconds a request)."""
    cpu = server_cpu(pid)
    began = time.perf_counter()
    for _ in range(count):
        one()
    seconds = time.perf_counter() - began
    return count / seconds, (server_cpu(pid) - cpu) / count * 1e6


def http_call(conn: http.client.HTTPConnection, method: str, path: str, body: bytes = b"") -> bytes:
    conn.request(method, path, body=body or None, headers={"Content-Type": "application/json"})
    reply = conn.getresponse()
    data = reply.read()
    assert reply.status < 300, (reply.status, data[:200])
    return data


def fill(wire: JobserverClient, jobs: int) -> None:
    """`jobs` jobs in 100 queues, by CreateJobs of 1,000."""
    for start in range(0, jobs, 1000):
        batch = [{"name": f"q{(start + i) % 100}/x"} for i in range(min(1000, jobs - start))]
        status, _ = wire.request(
            b"CreateJobs\r\njobs: " + json.dumps(batch).encode() + b"\r\n\r\n"
        )
        assert status.startswith("200"), status


def median_ms(call: Callable[[], object]) -> float:
    times = []
    for _ in range(5):
        began = time.perf_counter()
        call()
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer creates, a smaller queue")
    args = parser.parse_args()
    creates, queued = (500, 20_000) if args.quick else (2000, 100_000)
    with tempfile.TemporaryDirectory() as workdir:
        port, http_port = free_port(), free_port()
        proc = start_server(
            Path(workdir) / "bench.db", port, ROOT, "--synchronous", "FULL",
            "--http-port", str(http_port),
        )
        try:
            wait_port(port, proc)
            wait_port(http_port, proc)
            wire = JobserverClient(port)
            conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)
            body = json.dumps({"type": "bench", "payload": {"p": PAYLOAD[:90].decode()}}).encode()
            wire_rate, wire_cpu = timed(creates, wire.put, proc.pid)
            http_rate, http_cpu = timed(
                creates, lambda: http_call(conn, "POST", "/queue", body), proc.pid
            )
            fill(wire, queued)
            scrape = median_ms(lambda: http_call(conn, "GET", "/metrics"))
            queues = median_ms(lambda: http_call(conn, "POST", "/api/Queues", b"{}"))
            page = median_ms(lambda: http_call(conn, "GET", "/"))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print("| create, 1 client | rate | server CPU |\n|---|---|---|")
    print(f"| wire CreateJob | {wire_rate:,.0f}/s | {wire_cpu:,.0f} µs |")
    print(f"| HTTP POST /queue | {http_rate:,.0f}/s | {http_cpu:,.0f} µs |")
    print(f"| HTTP / wire | {http_rate / wire_rate:.2f}x | {http_cpu / wire_cpu:.2f}x |")
    print(f"\nAt {queued + 2 * creates:,} jobs in 102 queues (median of 5):")
    print(f"GET /metrics {scrape:.1f} ms, POST /api/Queues {queues:.1f} ms, GET / {page:.1f} ms")


if __name__ == "__main__":
    main()
