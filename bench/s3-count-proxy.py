#!/usr/bin/env python3
"""A TCP proxy that counts bytes in each direction between S3 clients and the S3 server.

usage: s3-count-proxy.py LISTEN_PORT TARGET_PORT COUNTERS_FILE [REQUEST_LOG]
The counters file holds "bytes_to_server bytes_to_client" and is rewritten whenever they
change (at most every 100 ms), so a benchmark reads the wire bytes of each workload as the
difference of two snapshots. HTTP headers are included: that is what a store bills and carries.
With REQUEST_LOG, every request's line is appended to it as `"METHOD /path HTTP/1.1"` (the
shape of moto's log, for a store without a request log of its own): requests are found by
parsing each connection's stream, headers then Content-Length bytes of body.
"""
import asyncio
import sys

listen_port, target_port, counters_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
counters = [0, 0]
request_log = open(sys.argv[4], "a", buffering=1) if len(sys.argv) > 4 else None


class RequestParser:
    """Finds the request lines in one connection's client-to-server bytes."""

    def __init__(self):
        self.buffer = b""
        self.body_left = 0

    def feed(self, data):
        while data:
            if self.body_left:
                taken = min(self.body_left, len(data))
                self.body_left -= taken
                data = data[taken:]
                continue
            self.buffer += data
            data = b""
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head, data = self.buffer[:end], self.buffer[end + 4 :]
            self.buffer = b""
            lines = head.split(b"\r\n")
            request_log.write('"' + lines[0].decode("latin-1") + '"\n')
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    self.body_left = int(value.strip() or 0)


async def pump(reader, writer, index):
    parser = RequestParser() if index == 0 and request_log else None
    try:
        while True:
            data = await reader.read(1 << 16)
            if not data:
                break
            counters[index] += len(data)
            if parser:
                parser.feed(data)
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            writer.close()
        except Exception:
            pass


async def handle(client_reader, client_writer):
    try:
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target_port)
    except OSError:
        client_writer.close()
        return
    await asyncio.gather(
        pump(client_reader, server_writer, 0), pump(server_reader, client_writer, 1)
    )


async def write_counters():
    last = None
    while True:
        if counters != last:
            last = list(counters)
            with open(counters_path + ".tmp", "w") as file:
                file.write(f"{last[0]} {last[1]}\n")
            import os

            os.replace(counters_path + ".tmp", counters_path)
        await asyncio.sleep(0.1)


async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", listen_port)
    asyncio.ensure_future(write_counters())
    async with server:
        await server.serve_forever()


asyncio.run(main())
