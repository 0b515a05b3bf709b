"""Hosts for multi-host tests: Linux network namespaces joined by veth pairs to a bridge, all made and
removed by the test (root and iproute2 needed; `skip_reason()` says why they cannot be made).

    with Network(3) as net:        # hosts net.hosts[0..2] at net.addr(0..2); this process at net.client_addr
        proc = net.popen(0, [sys.executable, "server.py", "--host", net.addr(0), ...])
        net.cut(0)                 # the host's link down: its packets are dropped, no RST reaches anyone
        net.restore(0)

The bridge lives in its own namespace, and this process joins it through one more veth pair, so the test
talks only to the addresses it made (10.231.N.0/24), never to the machine's own network.
"""

import os
import shutil
import subprocess


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def skip_reason() -> str | None:
    """Why namespaces cannot be made here (not root, no iproute2, no permission), or None."""
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (Debian: apt-get install iproute2)"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    name = f"mvprobe{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except subprocess.CalledProcessError as e:
        return f"cannot create a network namespace: {e.stderr.strip()}"
    _ip("netns", "del", name)
    return None


class Network:
    """`n` hosts on one bridge. Host i is namespace `{prefix}h{i}` with interface eth0 at addr(i)."""

    made = 0  # networks made by this process, so that several may exist at once

    def __init__(self, n: int):
        Network.made += 1
        self.n, self.subnet = n, (os.getpid() + Network.made) % 200 + 20
        self.prefix = f"mv{os.getpid() % 100000}n{Network.made % 10}"  # interface names: 15 characters at most
        self.switch = f"{self.prefix}sw"
        self.client_addr = f"10.231.{self.subnet}.254"
        self.procs: list[subprocess.Popen] = []

    def addr(self, i: int) -> str:
        return f"10.231.{self.subnet}.{i + 1}"

    def ns(self, i: int) -> str:
        return f"{self.prefix}h{i}"

    def __enter__(self) -> "Network":
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i in range(self.n):
                ns = self.ns(i)
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("link", "add", f"{self.prefix}v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", f"{self.prefix}v{i}", "netns", self.switch)
                self._attach(f"{self.prefix}v{i}")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
            # this process's own link to the bridge
            _ip(
                "link",
                "add",
                f"{self.prefix}c",
                "type",
                "veth",
                "peer",
                "name",
                f"{self.prefix}cp",
                "netns",
                self.switch,
            )
            self._attach(f"{self.prefix}cp")
            _ip("addr", "add", f"{self.client_addr}/24", "dev", f"{self.prefix}c")
            _ip("link", "set", f"{self.prefix}c", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def _attach(self, port: str) -> None:
        _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")

    def popen(self, i: int, cmd: list[str], **kwargs) -> subprocess.Popen:
        """`cmd` run on host i (ip netns exec); stopped at exit if still running."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(i), *cmd], **kwargs)
        self.procs.append(proc)
        return proc

    def cut(self, i: int) -> None:
        """Host i's cable pulled: its bridge port goes down, packets to and from it are dropped silently."""
        _ip("-n", self.switch, "link", "set", f"{self.prefix}v{i}", "down")

    def restore(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", f"{self.prefix}v{i}", "up")

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        subprocess.run(["ip", "link", "del", f"{self.prefix}c"], capture_output=True)
        for ns in [self.ns(i) for i in range(self.n)] + [self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
