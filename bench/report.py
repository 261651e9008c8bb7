#!/usr/bin/env python3
"""Turns bench/run.sh's raw results (TSV: client, workload, run, value, requests,
request breakdown, new connections) into the Markdown report: medians, ratios, and the
S3 requests each workload cost."""
import argparse
import os
import platform
import statistics
import sys
from collections import defaultdict

ap = argparse.ArgumentParser()
ap.add_argument("results")
ap.add_argument("notes")
for a in ["peer-runs", "rtt", "big", "touch", "objects", "dirs", "wu", "md", "sql", "runs", "elapsed", "versions", "cpus", "dropped-caches"]:
    ap.add_argument("--" + a, default="")
args = ap.parse_args()

MOUNTS = ["s3csi", "s3csi-wb", "s3fs", "rclone", "rclone-w"]
PEERS = ["s3fs", "rclone", "rclone-w"]
COLS = MOUNTS + ["raw"]
# key, label, unit, higher is better
ROWS = [
    ("read", f"sequential read, {args.big} object", "MiB/s", True),
    ("write", f"sequential write, {args.big} file (size checked in S3)", "MiB/s", True),
    ("touch", f"{args.touch} × touch", "s", False),
    ("ls", f"ls -laR, {args.objects} objects in {args.dirs} dirs", "s", False),
    ("ls_meta", f"ls -laR, {args.objects} objects in {args.dirs} dirs, s3fs metadata on each", "s", False),
    ("write_unlink", f"{args.wu} × (write 1 KiB + close + unlink)", "s", False),
    ("md_create", f"mdtest create ({args.md} files)", "ops/s", True),
    ("md_stat", f"mdtest stat ({args.md} files)", "ops/s", True),
    ("md_remove", f"mdtest remove ({args.md} files)", "ops/s", True),
    ("edit_append", f"append 1 MiB to a {args.big} object + close", "s", False),
    ("edit_append_sent", "… MiB sent to S3 for that append", "MiB", False),
    ("edit_random", "1000 random 4 KiB writes into that object + close", "s", False),
    ("sqlite", f"SQLite: {args.sql} inserts, transactions of 100", "rows/s", True),
    ("rss", f"peak RSS during the {args.big} read", "MiB", False),
]
PER_FILE = {
    "touch": int(args.touch or 1),
    "write_unlink": int(args.wu or 1),
    "md_create": int(args.md or 1),
    "md_stat": int(args.md or 1),
    "md_remove": int(args.md or 1),
}

vals = defaultdict(list)  # (client, workload) -> [float]
bad = defaultdict(list)  # (client, workload) -> ["timeout", ...]
reqs = defaultdict(list)  # (client, workload) -> [(total, breakdown, conns)]
present = set()
for line in open(args.results):
    f = line.rstrip("\n").split("\t")
    if len(f) < 4:
        continue
    c, w, v = f[0], f[1], f[3]
    present.add(c)
    try:
        vals[(c, w)].append(float(v))
    except ValueError:
        bad[(c, w)].append(v or "error")
    if len(f) >= 7 and f[4] != "":
        reqs[(c, w)].append((int(f[4]), f[5].strip(), int(f[6] or 0)))


def med(c, w):
    v = vals.get((c, w))
    return statistics.median(v) if v else None


def fmt(x, unit):
    if x is None:
        return None
    if unit == "s":
        return f"{x:.2f} s"
    if unit == "MiB":
        return f"{x:.0f} MiB"
    return f"{x:,.0f} {unit}" if x >= 100 else f"{x:.1f} {unit}"


def cell(c, w, unit):
    if c not in present:
        return "skipped"
    m = med(c, w)
    if m is None:
        return "/".join(sorted(set(bad.get((c, w), ["–"]))))
    s = fmt(m, unit)
    if bad.get((c, w)):
        s += f" ({len(bad[(c, w)])} failed)"
    return s


def advantage(a, b, higher):
    """How many times better a is than b (>1: a wins)."""
    if a is None or b is None or a == 0 or b == 0:
        return None
    return a / b if higher else b / a


out = []
p = out.append
p(f"# s3csi benchmark — {args.rtt} ms RTT")
p("")
p(
    f"Machine: {platform.node()}, {os.cpu_count()} CPUs ({args.cpus or 'shared'}), "
    f"{platform.system()} {platform.release()}. "
    f"S3 server: moto on loopback (objects in memory, ranged GETs in O(range), no full-object "
    f"CRC64 at multipart completion; see bench/moto_server.py) "
    f"behind `s3bench proxy` ({args.rtt} ms RTT, +1 RTT per new connection), one proxy and "
    f"one bucket per client. Medians of {args.runs} run(s) for s3csi and raw S3, "
    f"{args.peer_runs} for s3fs and rclone, each on a fresh mount; raw S3 = `s3bench raw-read` / "
    f"`raw-write` (aws-sdk-s3 via s3csi's client, 8 MiB parts, 16 in flight); "
    f"page cache {'dropped' if args.dropped_caches == '1' else 'NOT dropped'} before every workload; "
    f"bench time {args.elapsed} s."
)
p(f"Versions: {args.versions}.")
p(
    "Options: s3csi defaults; s3fs defaults (`use_path_request_style`); rclone "
    "`--vfs-cache-mode off` (its `writes` mode acknowledges close before the upload, "
    "so it is not durable at close); rclone (writes) = `--vfs-cache-mode writes "
    "--vfs-write-back 0s` on the edit rows only, each timed until rclone reports no upload "
    "queued or under way; s3csi (write-back) = `--write-back 50ms` on the edit rows only, "
    "each timed until it keeps no edit for upload (the same trade: close and fsync return "
    "before S3 has the data)."
)
p("")
p("| workload | s3csi | s3csi (write-back) | s3fs | rclone | rclone (writes) | raw S3 | s3csi / raw S3 | s3csi vs best peer | s3csi (write-back) vs rclone (writes) |")
p("|---|---|---|---|---|---|---|---|---|---|")
for w, label, unit, higher in ROWS:
    cells = [cell(c, w, unit) if (c != "raw" or w in ("read", "write")) else "" for c in COLS]
    s = med("s3csi", w)
    raw = med("raw", w) if w in ("read", "write") else None
    r_raw = f"{s / raw * 100:.0f} %" if (s is not None and raw) else ""
    peers = [(med(c, w), c) for c in PEERS if med(c, w) is not None]
    r_peer = ""
    if s is not None and peers:
        best, who = (max if higher else min)(peers)
        adv = advantage(s, best, higher)
        if adv is not None:
            num = f"{adv:.2f}" if adv >= 0.1 else f"{adv:.1g}"
            r_peer = f"{num}× {'better' if adv >= 1 else 'worse'} ({who})"
    wb = advantage(med("s3csi-wb", w), med("rclone-w", w), higher)
    r_wb = f"{wb:.2f}× {'better' if wb >= 1 else 'worse'}" if wb is not None else ""
    p(f"| {label} | " + " | ".join(cells) + f" | {r_raw} | {r_peer} | {r_wb} |")
p("")
p("\"s3csi vs best peer\": how many times faster (or smaller, for RSS) s3csi is than the "
  "best of s3fs, rclone and rclone (writes) on that row; below 1× it loses. The last column "
  "compares the two that acknowledge close before the upload.")
p("")

# Requests per workload (the last run's counts; they barely vary between runs).
p("## S3 requests per workload (run 1)")
p("")
p("Counted from moto's request log (one line per request) and new TCP connections from "
  f"the proxy; at {args.rtt} ms RTT each sequential request costs ≥ 1 RTT, each new "
  "connection one more.")
p("")
p("| workload | " + " | ".join(c for c in MOUNTS + ["raw"] if c in present) + " |")
p("|---|" + "---|" * len([c for c in MOUNTS + ["raw"] if c in present]))
for w, label, unit, higher in ROWS:
    if w == "rss":
        continue
    row = []
    for c in MOUNTS + ["raw"]:
        if c not in present:
            continue
        r = reqs.get((c, w))
        if not r:
            row.append("")
            continue
        total, brk, conns = r[0]
        per = PER_FILE.get(w)
        s = f"{total}"
        if per:
            s += f" ({total / per:.2f}/file)"
        s += f", {conns} conn<br>{brk}"
        row.append(s)
    p(f"| {label} | " + " | ".join(row) + " |")
p("")
notes = [n.strip() for n in open(args.notes) if n.strip()]
if notes:
    p("Notes:")
    p("")
    for n in notes:
        p(f"- {n}")
print("\n".join(out))
