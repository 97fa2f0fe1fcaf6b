#!/usr/bin/env python3
"""An HTTP proxy in front of an S3 server that refuses chosen requests without forwarding them.

usage: refuse_proxy.py LISTEN_PORT TARGET_PORT METHODS STATUS CODE
Requests whose method is in METHODS (comma-separated, e.g. PUT,DELETE) are not forwarded:
they are answered STATUS with an S3 error document whose <Code> is CODE (403 AccessDenied: a
store whose credentials may not write; 500 InternalError: a store failing), or, with STATUS
0, the connection is closed without an answer (a network failure). Every other request is
forwarded to the server on TARGET_PORT and its answer relayed. The port is ready when
LISTEN_PORT accepts connections.
"""
import http.client
import http.server
import sys

listen_port, target_port = int(sys.argv[1]), int(sys.argv[2])
methods = set(sys.argv[3].split(","))
status, code = int(sys.argv[4]), sys.argv[5]

ERROR_BODY = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>%s</Code>'
    "<Message>refused by the test proxy</Message></Error>" % code
).encode()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *arguments):
        pass

    def forward(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        if self.command in methods:
            if status == 0:
                self.close_connection = True
                self.connection.close()
                return
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(ERROR_BODY)))
            self.end_headers()
            self.wfile.write(ERROR_BODY)
            return
        connection = http.client.HTTPConnection("127.0.0.1", target_port, timeout=60)
        headers = {name: value for name, value in self.headers.items()}
        connection.request(self.command, self.path, body=body, headers=headers)
        answer = connection.getresponse()
        answer_body = answer.read()
        connection.close()
        self.send_response(answer.status)
        for name, value in answer.getheaders():
            if name.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(answer_body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(answer_body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward


http.server.ThreadingHTTPServer(("127.0.0.1", listen_port), Handler).serve_forever()
