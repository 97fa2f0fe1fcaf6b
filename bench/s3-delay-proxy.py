#!/usr/bin/env python3
"""A TCP proxy in front of an S3 server that delays every HTTP request and counts concurrency.

usage: s3-delay-proxy.py LISTEN_PORT TARGET_PORT DELAY_MS COUNTERS_FILE
Each request's first bytes are held DELAY_MS before they go on (a remote store's round trip).
A connection has a request in flight from its request's first byte until the first byte of
the answer (HTTP/1.1 clients such as object_store do not pipeline, so a connection carries
one request at a time). The counters file holds "requests inflight_max inflight_now" and is
rewritten at most every 50 ms; `reset` written to COUNTERS_FILE.reset zeroes the maximum.
"""
import asyncio
import os
import sys

listen_port, target_port = int(sys.argv[1]), int(sys.argv[2])
delay_s, counters_path = float(sys.argv[3]) / 1000.0, sys.argv[4]
state = {"requests": 0, "inflight": 0, "inflight_max": 0}


class Connection:
    def __init__(self):
        self.active = False

    def start(self):
        if not self.active:
            self.active = True
            state["requests"] += 1
            state["inflight"] += 1
            state["inflight_max"] = max(state["inflight_max"], state["inflight"])
            return True
        return False

    def answer(self):
        if self.active:
            self.active = False
            state["inflight"] -= 1


async def to_server(reader, writer, connection):
    try:
        while True:
            data = await reader.read(1 << 16)
            if not data:
                break
            if connection.start() and delay_s > 0:
                await asyncio.sleep(delay_s)
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def to_client(reader, writer, connection):
    try:
        while True:
            data = await reader.read(1 << 16)
            if not data:
                break
            connection.answer()
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        connection.answer()
        writer.close()


async def handle(client_reader, client_writer):
    try:
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target_port)
    except OSError:
        client_writer.close()
        return
    connection = Connection()
    await asyncio.gather(
        to_server(client_reader, server_writer, connection),
        to_client(server_reader, client_writer, connection),
    )


async def write_counters():
    last = None
    while True:
        reset = counters_path + ".reset"
        if os.path.exists(reset):
            os.remove(reset)
            state["inflight_max"] = state["inflight"]
        now = (state["requests"], state["inflight_max"], state["inflight"])
        if now != last:
            last = now
            with open(counters_path + ".tmp", "w") as file:
                file.write(" ".join(str(value) for value in now) + "\n")
            os.replace(counters_path + ".tmp", counters_path)
        await asyncio.sleep(0.05)


async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", listen_port, backlog=1024)
    asyncio.ensure_future(write_counters())
    async with server:
        await server.serve_forever()


asyncio.run(main())
