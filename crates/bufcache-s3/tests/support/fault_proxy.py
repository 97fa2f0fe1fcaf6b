#!/usr/bin/env python3
"""An HTTP proxy in front of an S3 server that loses the answers of chosen requests.

usage: fault_proxy.py LISTEN_PORT TARGET_PORT FAULTS_LOG SUFFIX COUNT [ignore-conditions | reset:SKIP | reset-deletes-too:SKIP | reset-percent:PERCENT:SEED]
Every request is forwarded to the server on TARGET_PORT and its answer relayed, except the
first COUNT PUTs whose path ends with SUFFIX: those are carried out by the server, but the
client is answered 500 InternalError instead, as when a store applies a write and the answer
is lost. Each such fault appends a line "PUT PATH STATUS" (the server's real status) to
FAULTS_LOG. With `ignore-conditions`, the If-None-Match and If-Match headers are dropped
from every request, so the server behaves as a store that ignores them (s3rver 3.7.1 stores a
create-only PUT of an existing object again and answers 200). With `reset:SKIP`, the first SKIP
such PUTs pass and the next COUNT are carried out and then answered with a connection reset
(TCP RST, no answer) instead of a 500; `reset-deletes-too:SKIP` counts and resets DELETEs of
such keys as well. With `reset-percent:PERCENT:SEED`, every request of any method whose path
ends with SUFFIX (COUNT is ignored) is carried out and then, with probability PERCENT % drawn
from a generator seeded with SEED (printed on stdout), answered with a connection reset. The
port is ready when
LISTEN_PORT accepts connections.
"""
import http.client
import http.server
import random
import socket
import struct
import sys
import threading

listen_port, target_port = int(sys.argv[1]), int(sys.argv[2])
faults_log, suffix, faults_left = sys.argv[3], sys.argv[4], [int(sys.argv[5])]
ignore_conditions = len(sys.argv) > 6 and sys.argv[6] == "ignore-conditions"
mode = sys.argv[6] if len(sys.argv) > 6 else ""
reset_skip = [int(mode.split(":")[1])] if mode.startswith(("reset:", "reset-deletes-too:")) else None
faulted_methods = ("PUT", "DELETE") if mode.startswith("reset-deletes-too:") else ("PUT",)
reset_percent = None
if mode.startswith("reset-percent:"):
    _, percent, seed = mode.split(":")
    reset_percent, reset_random = float(percent), random.Random(int(seed))
    print(f"fault proxy: resetting {reset_percent} % of requests, seed {seed}", flush=True)
lock = threading.Lock()

ERROR_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
    b"<Message>injected: the request was carried out but its answer is lost</Message></Error>"
)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *arguments):
        pass

    def forward(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        connection = http.client.HTTPConnection("127.0.0.1", target_port, timeout=60)
        headers = {
            name: value
            for name, value in self.headers.items()
            if not (ignore_conditions and name.lower() in ("if-none-match", "if-match"))
        }
        connection.request(self.command, self.path, body=body, headers=headers)
        answer = connection.getresponse()
        answer_body = answer.read()
        connection.close()
        fault = False
        if reset_percent is not None:
            if self.path.split("?")[0].endswith(suffix):
                with lock:
                    fault = reset_random.random() * 100 < reset_percent
        elif self.command in faulted_methods and self.path.split("?")[0].endswith(suffix):
            with lock:
                if reset_skip is not None and reset_skip[0] > 0:
                    reset_skip[0] -= 1
                elif faults_left[0] > 0:
                    faults_left[0] -= 1
                    fault = True
        if fault:
            with open(faults_log, "a") as log:
                log.write(f"{self.command} {self.path} {answer.status}\n")
            if reset_skip is not None or reset_percent is not None:
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()
                self.close_connection = True
                return
            self.send_response(500)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(ERROR_BODY)))
            self.end_headers()
            self.wfile.write(ERROR_BODY)
            return
        self.send_response(answer.status)
        for name, value in answer.getheaders():
            if name.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(answer_body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(answer_body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward


class Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        # A client killed mid-request (kill -9 tests) is expected, not worth a traceback.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


Server(("127.0.0.1", listen_port), Handler).serve_forever()
