#!/usr/bin/env python3
"""Turns bench/run.sh's raw results (TSV: server, client, workload, run, value, requests,
request breakdown, new connections) into the Markdown report: medians, ratios per server,
and the S3 requests each workload cost (counted on moto)."""
import argparse
import os
import platform
import statistics
import sys
from collections import defaultdict

ap = argparse.ArgumentParser()
ap.add_argument("results")
ap.add_argument("notes")
for a in ["peer-runs", "rtt", "big", "touch", "objects", "dirs", "wu", "md", "sql", "runs", "elapsed", "versions", "cpus", "dropped-caches", "many", "par", "cp", "cp-size", "md-procs", "servers"]:
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
    ("many_seq", f"{args.many} × 1 MiB files read once in name order, 1 reader", "s", False),
    ("many_par", f"the same {args.many} files, 8 readers at once", "s", False),
    ("par_read", f"{args.par} processes each reading its own {args.big} object", "MiB/s", True),
    ("cp_small", f"cp -r of {args.cp} files of {int(args.cp_size or 0) // 1024} KiB into the mount", "s", False),
    ("md4_create", f"mdtest create, {args.md_procs} processes ({args.md} files in all)", "ops/s", True),
    ("md4_stat", f"mdtest stat, {args.md_procs} processes", "ops/s", True),
    ("md4_remove", f"mdtest remove, {args.md_procs} processes", "ops/s", True),
    ("rss", f"peak RSS during the {args.big} read", "MiB", False),
    ("cpu_read", "mounter CPU (user + sys) per GiB read", "s/GiB", False),
    ("cpu_write", "mounter CPU per GiB written", "s/GiB", False),
    ("cpu_par", f"mounter CPU per GiB read by {args.par} processes", "s/GiB", False),
]
RAW_ROWS = ("read", "write", "par_read")
SERVERS = (args.servers or "moto").split()
SERVER_NAME = {"moto": "moto", "fast": "fast (embedded)"}
PER_FILE = {
    "touch": int(args.touch or 1),
    "write_unlink": int(args.wu or 1),
    "md_create": int(args.md or 1),
    "md_stat": int(args.md or 1),
    "md_remove": int(args.md or 1),
    "many_seq": int(args.many or 1),
    "many_par": int(args.many or 1),
    "cp_small": int(args.cp or 1),
    "md4_create": int(args.md or 1),
    "md4_stat": int(args.md or 1),
    "md4_remove": int(args.md or 1),
}

vals = defaultdict(list)  # (server, client, workload) -> [float]
bad = defaultdict(list)  # (server, client, workload) -> ["timeout", ...]
reqs = defaultdict(list)  # (server, client, workload) -> [(total, breakdown, conns)]
present = set()  # clients
for line in open(args.results):
    f = line.rstrip("\n").split("\t")
    if len(f) < 5:
        continue
    srv, c, w, v = f[0], f[1], f[2], f[4]
    present.add(c)
    try:
        vals[(srv, c, w)].append(float(v))
    except ValueError:
        bad[(srv, c, w)].append(v or "error")
    if len(f) >= 8 and f[5] != "":
        reqs[(srv, c, w)].append((int(f[5]), f[6].strip(), int(f[7] or 0)))


def med(srv, c, w):
    v = vals.get((srv, c, w))
    return statistics.median(v) if v else None


def fmt(x, unit):
    if x is None:
        return None
    if unit == "s":
        return f"{x:.2f} s"
    if unit == "MiB":
        return f"{x:.0f} MiB"
    if unit == "s/GiB":
        return f"{x:.2f} s/GiB"
    return f"{x:,.0f} {unit}" if x >= 100 else f"{x:.1f} {unit}"


def cell(srv, c, w, unit):
    if c not in present:
        return "skipped"
    m = med(srv, c, w)
    if m is None:
        return "/".join(sorted(set(bad.get((srv, c, w), ["–"]))))
    s = fmt(m, unit)
    if bad.get((srv, c, w)):
        s += f" ({len(bad[(srv, c, w)])} failed)"
    return s


def measured(srv, w):
    return any((srv, c, w) in vals or (srv, c, w) in bad for c in COLS)


def advantage(a, b, higher):
    """How many times better a is than b (>1: a wins)."""
    if a is None or b is None or a == 0 or b == 0:
        return None
    return a / b if higher else b / a


out = []
p = out.append
p(f"# s3csi benchmark — {args.rtt} ms RTT, servers: {', '.join(SERVER_NAME.get(x, x) for x in SERVERS)}")
p("")
p(
    f"Machine: {platform.node()}, {os.cpu_count()} CPUs ({args.cpus or 'shared'}), "
    f"{platform.system()} {platform.release()}. "
    f"S3 servers, each on loopback behind `s3bench proxy` ({args.rtt} ms RTT, +1 RTT per new "
    f"connection), one proxy and one bucket per client: **moto** (bench/moto_server.py: objects "
    f"in memory, ranged GETs in O(range), no full-object CRC64 at multipart completion; faithful "
    f"S3 metadata, slow data, and a request log, so the request counts below are its) and "
    f"**fast**, the embedded `s3csi s3-server` on a directory in /dev/shm, in memory as moto's objects are (its data path is not the "
    f"limit, so s3csi / raw S3 there is what the FUSE path costs). "
    f"Medians of {args.runs} run(s) for s3csi and raw S3, "
    f"{args.peer_runs} for s3fs and rclone, each on a fresh mount; raw S3 = `s3bench raw-read` / "
    f"`raw-write` (aws-sdk-s3 via s3csi's client, 8 MiB parts, 16 in flight; on the fast server "
    f"it reads faster than boto3 with 16 threads, see bench/raw_fast.sh); "
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
    "before S3 has the data). The mounter's CPU is the mount process's user + sys time "
    "(the kernel's FUSE work in the reader's context is not in it)."
)
p("")
p("| workload | server | s3csi | s3csi (write-back) | s3fs | rclone | rclone (writes) | raw S3 | s3csi / raw S3 | s3csi vs best peer | s3csi (write-back) vs rclone (writes) |")
p("|---|---|---|---|---|---|---|---|---|---|---|")
for w, label, unit, higher in ROWS:
    first = True
    for srv in SERVERS:
        if not measured(srv, w):
            continue
        cells = [cell(srv, c, w, unit) if (c != "raw" or w in RAW_ROWS) else "" for c in COLS]
        s = med(srv, "s3csi", w)
        raw = med(srv, "raw", w) if w in RAW_ROWS else None
        r_raw = f"{s / raw * 100:.0f} %" if (s is not None and raw) else ""
        peers = [(med(srv, c, w), c) for c in PEERS if med(srv, c, w) is not None]
        r_peer = ""
        if s is not None and peers:
            best, who = (max if higher else min)(peers)
            adv = advantage(s, best, higher)
            if adv is not None:
                num = f"{adv:.2f}" if adv >= 0.1 else f"{adv:.1g}"
                r_peer = f"{num}× {'better' if adv >= 1 else 'worse'} ({who})"
        wb = advantage(med(srv, "s3csi-wb", w), med(srv, "rclone-w", w), higher)
        r_wb = f"{wb:.2f}× {'better' if wb >= 1 else 'worse'}" if wb is not None else ""
        p(f"| {label if first else '″'} | {SERVER_NAME.get(srv, srv)} | " + " | ".join(cells) + f" | {r_raw} | {r_peer} | {r_wb} |")
        first = False
p("")
p("\"s3csi vs best peer\": how many times faster (or smaller, for RSS and CPU) s3csi is than "
  "the best of s3fs, rclone and rclone (writes) on that row; below 1× it loses. The last column "
  "compares the two that acknowledge close before the upload.")
p("")

# Requests per workload (the first run's counts; they barely vary between runs), on moto.
REQ_SRV = "moto"
if any(k[0] == REQ_SRV for k in reqs):
    p("## S3 requests per workload (moto, run 1)")
    p("")
    p("Counted from moto's request log (one line per request) and new TCP connections from "
      f"the proxy; at {args.rtt} ms RTT each sequential request costs ≥ 1 RTT, each new "
      "connection one more.")
    p("")
    cols = [c for c in MOUNTS + ["raw"] if c in present]
    p("| workload | " + " | ".join(cols) + " |")
    p("|---|" + "---|" * len(cols))
    for w, label, unit, higher in ROWS:
        row = []
        for c in cols:
            r = reqs.get((REQ_SRV, c, w))
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
        if any(row):
            p(f"| {label} | " + " | ".join(row) + " |")
    p("")
notes = [n.strip() for n in open(args.notes) if n.strip()]
if notes:
    p("Notes:")
    p("")
    for n in notes:
        p(f"- {n}")
print("\n".join(out))
