#!/usr/bin/env python3
"""A TCP proxy that counts bytes in each direction between S3 clients and the S3 server.

usage: s3-count-proxy.py LISTEN_PORT TARGET_PORT COUNTERS_FILE
The counters file holds "bytes_to_server bytes_to_client" and is rewritten whenever they
change (at most every 100 ms), so a benchmark reads the wire bytes of each workload as the
difference of two snapshots. HTTP headers are included: that is what a store bills and carries.
"""
import asyncio
import sys

listen_port, target_port, counters_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
counters = [0, 0]


async def pump(reader, writer, index):
    try:
        while True:
            data = await reader.read(1 << 16)
            if not data:
                break
            counters[index] += len(data)
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
