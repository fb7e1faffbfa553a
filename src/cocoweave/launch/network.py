"""Sockets of a world on one host: a store that listens on one address only, and Gloo's pairs kept on the
loopback interface when the whole world met at a loopback address."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist


def listening_store(host: str, port: int, timeout_s: float, world_size: int | None = None) -> dist.TCPStore:
    """A master TCPStore whose socket listens on `host` only (torch's own binds every interface)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, kind, proto, _, address = next((i for i in infos if i[0] == socket.AF_INET), infos[0])
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(256)
        bound = sock.getsockname()[1]
        return dist.TCPStore(host, bound, world_size, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.detach())
    finally:
        sock.close()  # a no-op once detached


def _is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(i[4][0].startswith("127.") or i[4][0] == "::1" for i in infos)


def _use_loopback_for_gloo() -> None:
    """Make Gloo's pairs listen on the loopback interface (ranks on one host), unless the user chose Gloo's
    interface (GLOO_SOCKET_IFNAME): then it is left as they set it."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return
    ifname = next((n for n in ("lo", "lo0") if n in names), None)
    if ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
