"""A client process for the fault matrix: it brings a connection to one stage
of its life, says so, and then ends it the way it is told.

    python victim.py PORT STAGE NAME [--tls-ca FILE]

Prints `ready <local port>` once the stage is set up, then reads one line
from standard input: `fin` (close the socket), `rst` (close with SO_LINGER
0, so the kernel sends a reset) or `half` (shut down the sending side, then
read everything the server still sends: it prints `shut` once it has shut
down, then `got <JSON>` with the status lines and jobIDs it received whole).
Last it prints `done`. The harness may
instead kill it with SIGKILL at any point after `ready`.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import struct
import sys

# The stages (see tests/test_fault_matrix.py for what each one proves).
STAGES = (
    "idle", "mid-head", "mid-body", "before-reply", "waiting-getjob",
    "waiting-getjobs", "large-reply", "pipelined",
)

# A receive buffer this small makes the server block in the middle of a
# large reply instead of handing it all to the kernel.
SMALL_RCVBUF = 4096
PIPELINED_GETJOBS = 40


def connect(port: int, ca: str | None, small_buffer: bool) -> socket.socket:
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Each write goes out at once, so "ready" means it has been sent.
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if small_buffer:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_RCVBUF)
    raw.connect(("127.0.0.1", port))
    if ca is None:
        return raw
    context = ssl.create_default_context(cafile=ca)
    secure = context.wrap_socket(raw, server_hostname="localhost")
    return secure


def set_up(sock: socket.socket, stage: str, name: str) -> None:
    if stage == "idle":
        return
    if stage == "mid-head":
        sock.sendall(b"GetJob\r\nname: " + name.encode())
    elif stage == "mid-body":
        sock.sendall(
            b"CreateJob\r\nname: " + name.encode() + b"\r\nContent-Length: 100\r\n\r\n0123456789"
        )
    elif stage in ("before-reply", "large-reply"):
        verb = b"GetJobs\r\nnumResults: 100" if stage == "large-reply" else b"GetJob"
        sock.sendall(verb + b"\r\nname: " + name.encode() + b"\r\n\r\n")
    elif stage == "waiting-getjob":
        sock.sendall(
            b"GetJob\r\nname: " + name.encode() + b"\r\nConnection: wait\r\ntimeout: 60000\r\n\r\n"
        )
    elif stage == "waiting-getjobs":
        sock.sendall(
            b"GetJobs\r\nname: " + name.encode()
            + b"\r\nnumResults: 3\r\nConnection: wait\r\ntimeout: 60000\r\n\r\n"
        )
    elif stage == "pipelined":
        one = b"GetJob\r\nname: " + name.encode() + b"\r\n\r\n"
        sock.sendall(one * PIPELINED_GETJOBS)
    else:
        raise SystemExit(f"unknown stage {stage}")


def read_all(sock: socket.socket) -> dict[str, list]:
    """Every whole reply until the server closes: status lines and jobIDs."""
    buffer = b""
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except (ConnectionError, ssl.SSLError, OSError):
            break
        if not chunk:
            break
        buffer += chunk
    statuses, job_ids = [], []
    while b"\r\n\r\n" in buffer:
        head, rest = buffer.split(b"\r\n\r\n", 1)
        lines = head.decode().split("\r\n")
        length = next(
            int(line.split(": ", 1)[1]) for line in lines if line.startswith("Content-Length")
        )
        if len(rest) < length:
            break
        body, buffer = rest[:length], rest[length:]
        statuses.append(lines[0])
        if lines[0].startswith("200") and body:
            value = json.loads(body)
            jobs = value.get("jobs", [value]) if isinstance(value, dict) else []
            job_ids += [job["jobID"] for job in jobs if "jobID" in job]
    return {"statuses": statuses, "jobIDs": job_ids}


def drain(sock: socket.socket) -> None:
    """Read what has arrived, once: reading on would take a reply the
    stage means to leave unread."""
    sock.setblocking(False)
    with contextlib.suppress(BlockingIOError, ssl.SSLWantReadError, ssl.SSLError, ConnectionError):
        sock.recv(1 << 20)


def end(sock: socket.socket, how: str) -> None:
    if how == "fin":
        # Whatever already arrived is read first (TLS session tickets, a
        # reply's first bytes): with unread data the kernel would send a
        # reset instead of the FIN this ending is about.
        drain(sock)
        sock.close()
    elif how == "rst":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    elif how == "half":
        # The TCP socket's own shutdown: SSLSocket.shutdown would drop TLS,
        # and the replies still to come must be read through it.
        socket.socket.shutdown(sock, socket.SHUT_WR)
        print("shut", flush=True)
        print("got " + json.dumps(read_all(sock)), flush=True)
        sock.close()
    else:
        raise SystemExit(f"unknown ending {how}")


def main() -> None:
    port, stage, name = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    ca = sys.argv[5] if len(sys.argv) > 5 and sys.argv[4] == "--tls-ca" else None
    sock = connect(port, ca, small_buffer=stage in ("large-reply", "pipelined"))
    set_up(sock, stage, name)
    print(f"ready {sock.getsockname()[1]}", flush=True)
    end(sock, sys.stdin.readline().strip())
    print("done", flush=True)


if __name__ == "__main__":
    main()
