"""Which pages each commit writes to SQLite's log, by table and index.

    python bench/wal_frames.py                   # 300 of each, this checkout
    python bench/wal_frames.py -n 1000 --server-root DIR

SQLite appends one frame to the log (the -wal file) for every page a
commit changed, each as two `pwrite64` calls (its 24-byte header, then the
page): a commit's writes are twice its pages. This script starts `jobserver
serve` on a fresh SQLite file with `--synchronous FULL`, warms it up, then
runs N CreateJobs, then N takes (GetJob, FinishJob) from one connection,
each phase under `strace -xx -e pwrite64,read`, and reads the page number and commit
mark of each frame header. Pages are named by `dbstat`: the b-tree each
belonged to when the phase began or, for a page added since (a split, the
file growing), when it ended ("a page freed since" if neither); a page
moved meanwhile (the pruner gives free pages back) may be misnamed. Counts
are per commit, by the request that made it (a client's requests are one
commit each). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import re
import signal
import sqlite3
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from syscalls import ATTACH_TIMEOUT, attach, create, take, warmed
from wire_client import Client

ROOT = Path(__file__).resolve().parent.parent
# strace -xx writes every byte as \xNN, paths too: "-wal" is this.
WAL_SUFFIX = r"\\x2d\\x77\\x61\\x6c"
FRAME_HEADER = re.compile(r'pwrite64\(\d+<[^>]*' + WAL_SUFFIX + r'>, "((?:\\x[0-9a-f]{2})+)", 24,')
SOCKET_READ = re.compile(r' read\(\d+<[^>]*>, "((?:\\x[0-9a-f]{2})+)')
SHOWN = 0.05  # pages per commit below this are only in the total
# strace's options: the log's writes and the sockets' reads, in full, each
# with the file its descriptor names.
TRACING = ("-xx", "-y", "-e", "trace=pwrite64,read")


def pages_by_btree(db: Path) -> dict[int, str]:
    reader = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return {page: name for name, page in reader.execute("SELECT name, pageno FROM dbstat")}
    finally:
        reader.close()


def commits(lines: list[str], names: dict[int, str]) -> dict[str, tuple[int, Counter[str]]]:
    """By request (the method the server read last): how many commits, and
    the pages their frames held, by b-tree."""
    method = "?"
    pages: list[int] = []
    seen: dict[str, tuple[int, Counter[str]]] = {}
    for line in lines:
        read = SOCKET_READ.search(line)
        if read:
            text = bytes.fromhex(read.group(1).replace("\\x", ""))
            method = text.split(b"\r\n", 1)[0].decode(errors="replace")
            continue
        header = FRAME_HEADER.search(line)
        if not header:
            continue
        frame = bytes.fromhex(header.group(1).replace("\\x", ""))
        pages.append(int.from_bytes(frame[:4], "big"))
        if int.from_bytes(frame[4:8], "big"):  # the commit's last frame
            count, btrees = seen.get(method, (0, Counter()))
            btrees.update(names.get(page, "a page freed since") for page in pages)
            seen[method] = (count + 1, btrees)
            pages = []
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=300, help="creates, then takes (300)")
    parser.add_argument("--server-root", type=Path, default=ROOT, metavar="DIR")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db, out = Path(tmp) / "jobs.db", Path(tmp) / "strace.out"
        server, port = warmed(db, args.server_root.resolve(), creates=300)
        try:
            client = Client(port)
            seen: dict[str, tuple[int, Counter[str]]] = {}
            for phase in (create, take):
                began = pages_by_btree(db)
                tracer = attach(server.pid, out, TRACING)
                for _ in range(args.n):
                    phase(client)
                tracer.send_signal(signal.SIGINT)
                tracer.communicate(timeout=ATTACH_TIMEOUT)
                # Named as the phase began; a page added since, as it ended.
                names = {**pages_by_btree(db), **began}
                seen.update(commits(out.read_text().splitlines(), names))
            client.close()
        finally:
            server.terminate()
            server.wait()
    for method, (count, btrees) in seen.items():
        print(f"{method}: {count} commits, {sum(btrees.values()) / count:.2f} pages a commit")
        for name, pages in btrees.most_common():
            if pages / count >= SHOWN:
                print(f"    {name:<24}{pages / count:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
