"""Serve an aiohttp application on a socket of our own, so its address is known before the
first request (port 0 picks a free one): the replica publishes it, the router prints it."""

from __future__ import annotations

import socket
import ssl

from aiohttp import web


async def listen(
    app: web.Application,
    host: str,
    port: int,
    tls: ssl.SSLContext | None = None,
    reuse_port: bool = False,
) -> tuple[web.AppRunner, str]:
    """(the runner to clean up, "http://host:port", or https:// with a TLS context). With
    `reuse_port`, other processes may listen on the same port and the kernel spreads the
    connections over them (SO_REUSEPORT)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock, ssl_context=tls).start()
    bound_host, bound_port = sock.getsockname()[:2]
    return runner, f"{'https' if tls else 'http'}://{bound_host}:{bound_port}"
