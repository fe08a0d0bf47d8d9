"""Traces end to end: a mount, a worker and the S3 endpoint, each its own
process exporting OTLP/HTTP to a receiver this test runs (no collector
binary is installable here). One FUSE read must produce one trace with
spans from all three processes, linked parent to child by the W3C
traceparent each hop sends."""

from __future__ import annotations

import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from helpers import S3_ENV, lakecache_bin, start_s3, start_worker, stop_all, testproc, wait_for
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2


class Receiver:
    """An OTLP/HTTP (protobuf) trace receiver keeping every span."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                ok = self.path == "/v1/traces"
                if ok:
                    request = trace_service_pb2.ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    receiver.add(request)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        for rs in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for span in ss.spans:
                    fields = {a.key: a.value.string_value for a in span.attributes}
                    with self.lock:
                        self.spans.append(
                            {
                                "service": attrs.get("service.name", ""),
                                "trace": span.trace_id.hex(),
                                "id": span.span_id.hex(),
                                "parent": span.parent_span_id.hex(),
                                "name": span.name,
                                "attrs": fields,
                            }
                        )

    def snapshot(self) -> list[dict]:
        with self.lock:
            return list(self.spans)


def end_to_end_trace(spans: list[dict]) -> list[dict] | None:
    """The spans of a trace where a FUSE read's request reached the worker
    and the worker's S3 GET reached the endpoint, each hop a child of the
    one before."""
    by_id = {s["id"]: s for s in spans}
    for s3 in spans:
        if s3["service"] != "lakecache-s3" or s3["name"] != "s3_request":
            continue
        chain = [s3]
        node = s3
        while node["parent"] in by_id:
            node = by_id[node["parent"]]
            chain.append(node)
        services = [s["service"] for s in chain]
        fuse_reads = [s for s in chain if s["name"] == "fuse" and s["attrs"].get("op") == "read"]
        if "lakecache-worker" in services and fuse_reads:
            return list(reversed(chain))
    return None


def test_one_fuse_read_is_one_trace_across_mount_worker_and_s3(tmp_path: Path) -> None:
    binary = lakecache_bin()
    receiver = Receiver()
    otel = {
        "LAKECACHE_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        # Export within a fraction of a second instead of every 5 s.
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    env = {**os.environ, **S3_ENV, **otel}
    s3, s3_port = start_s3(binary, tmp_path / "s3", env)
    procs = [s3]
    mnt = tmp_path / "mnt"
    try:
        worker, worker_port = start_worker(binary, tmp_path / "cache", s3_port, env)
        procs.append(worker)
        registry = f"static:127.0.0.1:{worker_port}"
        procs.append(
            testproc.Child(
                "mount", [binary, "mount", "s3://data", str(mnt), "--registry", registry], env=env
            )
        )
        wait_for("the mount", lambda: os.path.ismount(mnt))
        payload = os.urandom(3 << 20)
        (mnt / "shard-0.bin").write_bytes(payload)
        # Evict the worker's pages and the kernel's, so the read below is
        # cold: FUSE read -> worker -> S3 GetObject.
        subprocess.run([binary, "free", "s3://data/", "--registry", registry], env=env, check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3")
        assert (mnt / "shard-0.bin").read_bytes() == payload

        found: list[dict] | None = None

        def traced() -> bool:
            nonlocal found
            found = end_to_end_trace(receiver.snapshot())
            return found is not None

        wait_for("one trace across mount, worker and S3", traced, secs=30)
        assert found is not None
        print("trace", found[0]["trace"])
        for span in found:
            print(f"  {span['service']:<18} {span['name']:<12} {span['id']} <- {span['parent']}")
        services = {s["service"] for s in found}
        assert services == {"lakecache-mount", "lakecache-worker", "lakecache-s3"}
        assert len({s["trace"] for s in found}) == 1
        worker_request = next(s for s in found if s["name"] == "request")
        assert worker_request["attrs"].get("path", "").startswith("/v1/objects/data/shard-0.bin")
    finally:
        stop_all(procs)
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-uz", str(mnt)], check=False)
        receiver.server.shutdown()
