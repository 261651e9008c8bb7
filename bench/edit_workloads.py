#!/usr/bin/env python3
"""Edit-in-place workloads for bench/run.sh, run on a mounted file system.

  edit_workloads.py append FILE --size 1MiB        append SIZE bytes, close: prints secs=
  edit_workloads.py random-writes FILE --n 1000    N random 4 KiB pwrites, close: secs=
  edit_workloads.py sqlite DB --rows 10000         insert ROWS in transactions of 100: rows_per_s=

Each prints one line `RESULT key=value ...` (what bench/run.sh's `field` reads); the time
includes the close, when the file systems make the data durable.
"""
import argparse
import os
import random
import sqlite3
import sys
import time


def size(s):
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if s.endswith(u):
            return int(s[: -len(u)]) * m
    return int(s)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["append", "random-writes", "sqlite"])
    ap.add_argument("path")
    ap.add_argument("--size", default="1MiB")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--rows", type=int, default=10000)
    a = ap.parse_args()
    rnd = random.Random(5)
    if a.what == "append":
        data = os.urandom(size(a.size))
        t = time.monotonic()
        with open(a.path, "ab") as f:
            f.write(data)
        print(f"RESULT secs={time.monotonic() - t:.3f}")
    elif a.what == "random-writes":
        total = os.path.getsize(a.path)
        block = os.urandom(4096)
        t = time.monotonic()
        fd = os.open(a.path, os.O_WRONLY)
        try:
            for _ in range(a.n):
                os.pwrite(fd, block, rnd.randrange(0, max(1, total - 4096)))
        finally:
            os.close(fd)
        print(f"RESULT secs={time.monotonic() - t:.3f}")
    else:
        t = time.monotonic()
        c = sqlite3.connect(a.path)
        c.execute("create table t(i integer primary key, v text)")
        for b in range(0, a.rows, 100):
            with c:
                c.executemany("insert into t(v) values(?)", [("row %d" % (b + i),) for i in range(100)])
        c.close()
        secs = time.monotonic() - t
        c = sqlite3.connect(a.path)
        n = c.execute("select count(*) from t").fetchone()[0]
        ok = c.execute("pragma integrity_check").fetchone()[0]
        c.close()
        if n != a.rows or ok != "ok":
            sys.exit(f"sqlite: {n} rows, integrity {ok}")
        print(f"RESULT rows_per_s={a.rows / secs:.1f} secs={secs:.3f}")


if __name__ == "__main__":
    main()
