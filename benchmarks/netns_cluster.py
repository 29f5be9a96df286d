"""A pretend cluster on one machine: each "host" is a network namespace with its own hostname.

Hosts are joined by veth pairs to a bridge; each host's link is shaped with ``tc`` (token-bucket
rate limit). This kernel has no ``netem`` qdisc, so delay cannot be added: the latency is the veth's
own (tens of microseconds) and only the rate is set. Needs root; everything is removed on exit
(namespaces, veths, bridge), also after an error.

    with NetnsCluster(hosts=2, rate="1gbit") as cluster:
        procs = [cluster.popen(i, [...], env) for i in range(2)]
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Sequence


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class NetnsCluster:
    """``hosts`` namespaces on 10.78.0.0/24 behind a bridge, each link limited to ``rate``."""

    def __init__(self, hosts: int = 2, rate: str | None = "1gbit", subnet: str = "10.78.0") -> None:
        if os.geteuid() != 0:
            raise PermissionError("network namespaces need root")
        self.hosts = hosts
        self.rate = rate
        self.subnet = subnet
        tag = secrets.token_hex(2)
        self.names = [f"spn{tag}h{i}" for i in range(hosts)]
        self.bridge = f"spn{tag}br"
        self._created: list[str] = []

    def address(self, host: int) -> str:
        return f"{self.subnet}.{host + 1}"

    def interface(self, host: int) -> str:
        return f"eth{host}"

    def __enter__(self) -> NetnsCluster:
        try:
            _ip("link", "add", "name", self.bridge, "type", "bridge")
            self._created.append("bridge")
            _ip("link", "set", self.bridge, "up")
            for i, ns in enumerate(self.names):
                _ip("netns", "add", ns)
                self._created.append(ns)
                inner, outer = self.interface(i), f"{ns}o"
                _ip("link", "add", inner, "netns", ns, "type", "veth", "peer", "name", outer)
                _ip("link", "set", outer, "master", self.bridge)
                _ip("link", "set", outer, "up")
                _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", inner)
                _ip("-n", ns, "link", "set", inner, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                if self.rate:
                    subprocess.run(
                        ["tc", "-n", ns, "qdisc", "add", "dev", inner, "root", "tbf", "rate", self.rate,
                         "burst", "256kb", "latency", "200ms"],
                        check=True, capture_output=True, text=True,
                    )  # fmt: skip
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in reversed(self._created):
            if ns == "bridge":
                subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            else:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._created.clear()

    def popen(self, host: int, command: Sequence[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
        """Start ``command`` on ``host``: inside its namespace, with hostname ``host<i>``."""
        inner = f'hostname host{host} && exec "$@"'
        return subprocess.Popen(
            ["ip", "netns", "exec", self.names[host], "unshare", "--uts", "sh", "-c", inner, "sh", *command],
            env={**env, "GLOO_SOCKET_IFNAME": self.interface(host)},
            **kwargs,
        )
