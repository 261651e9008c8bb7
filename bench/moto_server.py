#!/usr/bin/env python3
"""moto for the benchmark: stock moto's S3 backend, with four differences from
`moto_server` that would otherwise distort a comparison of S3 clients.

1. Keep-alive. `moto_server` runs on werkzeug's development server, which answers every
   request with `Connection: close`, so every request costs a new TCP connection (one more
   round trip through the latency proxy) where real S3 keeps connections open. Here moto's
   WSGI app is served by waitress (`pip install waitress`), which keeps HTTP/1.1
   connections alive; without waitress it falls back to werkzeug and says so.
2. Ranged GETs cost O(range), not O(object). moto 5 answers `Range: bytes=a-b` by copying
   the *whole* object out of its buffer and then slicing (an 8 MiB range of a 1 GiB object
   took 1-2 s, 24 MiB/s for a 256 MiB object read in 8 MiB ranges); that penalises clients
   in proportion to how many ranged requests they send. A simple `bytes=a-b` range is
   served by seeking in the object's buffer instead.
3. waitress closes the connection after every response without Content-Length, which
   includes every 204 (DeleteObject); real S3 keeps it open. Patched for 1xx/204/304.
4. `versionId=null` on an unversioned bucket means "the object" on real S3; moto answers
   400 (rclone sends it in the HEAD after an upload and then fails close with EIO). It is
   dropped from the query string.
5. Objects live in memory. moto spools every object above 5 MiB to a temporary file, so a
   1 GiB upload wrote 2 GiB to the local disk (parts, then the completed object) and the
   server's data filled the page cache that a FUSE client shares with it and a remote
   server would not (a FUSE read then paid for the reclaim: 199-251 MiB/s against
   281-360 MiB/s after dropping caches). MOTO_S3_DEFAULT_KEY_BUFFER_SIZE keeps them in
   memory (bench/run.sh deletes what each workload wrote).
6. CompleteMultipartUpload without a checksum algorithm skips the full-object CRC64NVME
   that moto computes by default: pure-Python work over a second copy of the whole object,
   about half of moto's CPU in a 1 GiB write, paid serially after the last part, where S3
   answers in a time that hardly depends on the object's size. Every client in the bench
   asks for no checksum, so none loses anything it could check.

Every request is logged on stderr as one line, `... "METHOD PATH HTTP/1.1" STATUS -`,
like werkzeug's log, which bench/run.sh counts per workload.
Usage: moto_server.py -H HOST -p PORT.  S3BENCH_STOCK_MOTO=1 runs stock moto_server.
"""
import argparse
import os
import re
import signal
import sys
import threading
import time

from moto.s3 import models, responses

_tls = threading.local()
_SIMPLE_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


class _RangeBody:
    """Stands in for the object's bytes: knows its length, reads only the slice asked for."""

    def __init__(self, key):
        self.key = key
        self.n = key.size

    def __len__(self):
        return self.n

    def __bool__(self):
        return self.n > 0

    def __getitem__(self, s):
        start, stop, _ = s.indices(self.n)
        with self.key.lock:
            self.key._value_buffer.seek(start)
            return self.key._value_buffer.read(max(0, stop - start))


_orig_value = models.FakeKey.value


def _value(self):
    if getattr(_tls, "lazy", False):
        return _RangeBody(self)
    return _orig_value.fget(self)


_orig_get_object = responses.S3Response.get_object


def _get_object(self):
    m = _SIMPLE_RANGE.fullmatch(self.headers.get("range", "") or "")
    # Only when _handle_range_header will certainly slice (start within the object).
    _tls.lazy = bool(m) and not self._get_int_param("partNumber")
    try:
        status, headers, body = _orig_get_object(self)
    finally:
        _tls.lazy = False
    if isinstance(body, _RangeBody):
        start = int(m.group(1))
        end = int(m.group(2)) if m.group(2) else body.n - 1
        if status != 200 or start > min(end, body.n - 1):
            body = body[0 : body.n]  # let moto handle the odd cases on real bytes
    return status, headers, body


_orig_add_part = models.MultipartChecksumBuilder.addPart
_orig_build = models.MultipartChecksumBuilder.build


def _asked_for_checksum(builder):
    # __init__ turns "no algorithm" into CRC64NVME/FULL_OBJECT; remember what was asked
    return getattr(builder, "_s3bench_asked", True)


def _add_part(self, part):
    if _asked_for_checksum(self):
        _orig_add_part(self, part)


def _build(self):
    return _orig_build(self) if _asked_for_checksum(self) else None


_orig_builder_init = models.MultipartChecksumBuilder.__init__


def _builder_init(self, checksum_algorithm, checksum_type):
    _orig_builder_init(self, checksum_algorithm, checksum_type)
    self._s3bench_asked = bool(checksum_algorithm)


if not os.environ.get("S3BENCH_STOCK_MOTO"):
    models.FakeKey.value = property(_value, _orig_value.fset)
    responses.S3Response.get_object = _get_object
    models.MultipartChecksumBuilder.__init__ = _builder_init
    models.MultipartChecksumBuilder.addPart = _add_part
    models.MultipartChecksumBuilder.build = _build
    # read by moto when each key is created; 8 GiB: no object in the bench is spooled
    os.environ.setdefault("MOTO_S3_DEFAULT_KEY_BUFFER_SIZE", str(8 << 30))

def _logged(app):
    def wrapped(environ, start_response):
        qs = environ.get("QUERY_STRING", "")
        if "versionId=null" in qs:
            qs = "&".join(p for p in qs.split("&") if p != "versionId=null")
            environ["QUERY_STRING"] = qs
        status = []

        def sr(st, headers, exc_info=None):
            status.append(st.split(" ", 1)[0])
            return start_response(st, headers, exc_info)

        try:
            return app(environ, sr)
        finally:
            path = environ.get("PATH_INFO", "") + ("?" + qs if qs else "")
            ts = time.strftime("%d/%b/%Y %H:%M:%S")
            sys.stderr.write(
                f'127.0.0.1 - - [{ts}] "{environ["REQUEST_METHOD"]} {path} HTTP/1.1" '
                f'{status[0] if status else "-"} -\n'
            )
            sys.stderr.flush()

    return wrapped


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("-H", "--host", default="127.0.0.1")
    ap.add_argument("-p", "--port", type=int, default=5000)
    args = ap.parse_args(argv)
    os.environ.setdefault("MOTO_PORT", str(args.port))
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

    app = DomainDispatcherApplication(create_backend_app)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    try:
        import waitress
    except ImportError:
        sys.stderr.write("waitress missing: werkzeug server, no keep-alive (pip install waitress)\n")
        from werkzeug.serving import run_simple

        run_simple(args.host, args.port, _logged(app), threaded=True)
        return
    from waitress.task import Task

    orig_brh = Task.build_response_header

    def build_response_header(self):
        # no body, so no length needed: keep the connection (unless the client asked to close)
        if not self.has_body and self.request.headers.get("CONNECTION", "").lower() != "close":
            self.set_close_on_finish = lambda: None
            try:
                return orig_brh(self)
            finally:
                del self.set_close_on_finish
        return orig_brh(self)

    Task.build_response_header = build_response_header
    big = 256 << 20  # keep request and response bodies in memory, not in temp files
    waitress.serve(
        _logged(app),
        host=args.host,
        port=args.port,
        threads=int(os.environ.get("S3BENCH_MOTO_THREADS", "8")),
        connection_limit=1000,
        channel_timeout=300,
        inbuf_overflow=big,
        outbuf_overflow=big,
        outbuf_high_watermark=big,
        recv_bytes=1 << 18,
        send_bytes=1 << 18,
        _quiet=True,
    )


if __name__ == "__main__":
    if os.environ.get("S3BENCH_STOCK_MOTO"):
        from moto.server import main as stock_main

        sys.exit(stock_main(sys.argv[1:]))
    main(sys.argv[1:])
