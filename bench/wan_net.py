"""An emulated WAN on one Linux machine: hosts in network namespaces, shaped links, a delay line.

Layout (``Wan``): one router namespace ``gwwan-r`` and one namespace per host ``gwwan-h<i>``. Host ``i``
has ``eth0`` (10.77.<i>.2/24) joined by a veth pair to the router's ``v<i>`` (10.77.<i>.1/24), its
default route through the router. Every link is shaped in both directions with ``tc``: an HTB class
of the link's rate on the host's ``eth0`` egress (its uplink) and on the router's ``v<i>`` egress (its
downlink).

Delay. This kernel has no ``netem`` (nor ``fq``, which would honour a delivery time set by a BPF
program), and ``tbf``/``htb``'s ``latency`` and ``burst`` only bound a queue, they never hold a packet.
So the delay comes from a userspace delay line in the router namespace (``DelayLine``, run by
``python bench/wan_net.py delay-line``): policy routing sends every packet the router forwards into a
TUN device; the delay line reads each packet, holds it for the one-way delay, and writes it back into the
TUN device, from where the kernel routes it to its destination leg (rules: ``iif dly`` → the main table,
``iif v<i>`` → table 100, whose default route is ``dly``). Host to host, a packet crosses the delay
line once: one-way delay ``delay_ms``, round trip twice that, on top of the serialization on the two
shaped links. The delay line runs with real-time priority so a busy CPU does not stretch it; it is
plain Python, so the links use 9000-byte frames (jumbo frames) to keep its packet rate low (about
1,400 packets/s per direction at 100 Mbit/s). A run records how long the delay line actually held
packets (mean and maximum lateness), printed with the results.

Needs root (network namespaces, ``tc``, ``/dev/net/tun``): :func:`check_root` says so plainly.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import json
import math
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

#: Namespace names start with the prefix (``<prefix>-r``, ``<prefix>-h<i>``): a test uses its own.
PREFIX = "gwwan"
TUN = "dly"
MTU = 9000
DELAY_TABLE = 100


@dataclass(frozen=True)
class Link:
    """A link's shape: rate in Mbit/s and one-way host-to-host delay in ms (``name`` labels it)."""

    name: str
    mbit: float
    delay_ms: float


LINKS = {
    "100mbit": Link("100 Mbit/s, 25 ms one-way", 100.0, 25.0),
    "1gbit": Link("1 Gbit/s, 5 ms one-way", 1000.0, 5.0),
    "none": Link("unshaped (veth, no delay)", 0.0, 0.0),
}


class NeedsRoot(RuntimeError):
    """The WAN bench cannot run here (not root, or no network namespaces / tc / TUN)."""


def check_root() -> None:
    """Raise :class:`NeedsRoot` naming what is missing: root, ``ip``, ``tc``, ``/dev/net/tun``."""
    if os.geteuid() != 0:
        raise NeedsRoot(
            "bench/wan.py needs root: it creates network namespaces, veth pairs, a TUN device "
            "and tc qdiscs (run it as root, e.g. sudo .venv/bin/python bench/wan.py)"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NeedsRoot(f"bench/wan.py needs {' and '.join(missing)} (iproute2)")
    if not os.path.exists("/dev/net/tun"):
        raise NeedsRoot("bench/wan.py needs /dev/net/tun (the delay line is a TUN device)")
    probe = f"{PREFIX}-probe{os.getpid()}"
    _ip("netns", "del", probe, check=False)
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as e:
        raise NeedsRoot(f"cannot create a network namespace: {e.stderr.strip()}") from None
    finally:
        _ip("netns", "del", probe, check=False)


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run("ip", *args, check=check)


def _in(ns: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run("ip", "netns", "exec", ns, *cmd, check=check)


def host_ip(i: int) -> str:
    return f"10.77.{i}.2"


def _shape(ns: str, dev: str, mbit: float) -> None:
    """An HTB class of ``mbit`` Mbit/s as the root of ``dev``'s egress (every packet goes through it)."""
    _in(ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1", "r2q", "1000")
    burst = str(max(2 * MTU, int(mbit * 1e6 / 8 / 1000)))  # about 1 ms at the rate, at least two frames
    _in(
        ns,
        "tc",
        "class",
        "add",
        "dev",
        dev,
        "parent",
        "1:",
        "classid",
        "1:1",
        "htb",
        "rate",
        f"{mbit}mbit",
        "ceil",
        f"{mbit}mbit",
        "burst",
        burst,
        "cburst",
        burst,
    )


class Wan:
    """``hosts`` namespaces behind one router namespace, every link shaped as ``link`` (see the module).

    A context manager: entering builds it all and starts the delay line, leaving tears it all down
    (also whatever an interrupted earlier run left, at entry)."""

    def __init__(self, hosts: int, link: Link, log_dir: Path, prefix: str = PREFIX):
        self.hosts, self.link, self.log_dir, self.prefix = hosts, link, Path(log_dir), prefix
        self.router = f"{prefix}-r"
        self.delay_proc: subprocess.Popen | None = None
        self.delay_stats = self.log_dir / "delay_line.json"

    def __enter__(self) -> Wan:
        check_root()
        teardown(self.prefix)
        for stale in (self.delay_stats, self.delay_stats.with_suffix(".ready")):
            stale.unlink(missing_ok=True)
        try:
            self._build()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def ns(self, i: int) -> str:
        """Host ``i``'s namespace."""
        return f"{self.prefix}-h{i}"

    def _build(self) -> None:
        router = self.router
        _ip("netns", "add", router)
        _in(router, "ip", "link", "set", "lo", "up")
        for key in (
            "net.ipv4.ip_forward=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
            "net.ipv4.conf.all.send_redirects=0",
            "net.ipv4.conf.default.send_redirects=0",
        ):
            _in(router, "sysctl", "-qw", key)
        delayed = self.link.delay_ms > 0
        if delayed:
            _in(router, "ip", "tuntap", "add", "dev", TUN, "mode", "tun")
            _in(router, "sysctl", "-qw", f"net.ipv4.conf.{TUN}.rp_filter=0")
            _in(router, "ip", "link", "set", TUN, "mtu", str(MTU), "up")
            _in(router, "ip", "route", "add", "default", "dev", TUN, "table", str(DELAY_TABLE))
            _in(router, "ip", "rule", "add", "iif", TUN, "lookup", "main", "pref", "100")
        for i in range(self.hosts):
            ns, leg = self.ns(i), f"v{i}"
            _ip("netns", "add", ns)
            _in(ns, "ip", "link", "set", "lo", "up")
            _ip(
                "link",
                "add",
                leg,
                "netns",
                router,
                "mtu",
                str(MTU),
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
                "mtu",
                str(MTU),
            )
            _in(router, "ip", "addr", "add", f"10.77.{i}.1/24", "dev", leg)
            _in(router, "ip", "link", "set", leg, "up")
            _in(ns, "ip", "addr", "add", f"{host_ip(i)}/24", "dev", "eth0")
            _in(ns, "ip", "link", "set", "eth0", "up")
            _in(ns, "ip", "route", "add", "default", "via", f"10.77.{i}.1")
            if delayed:
                _in(router, "ip", "rule", "add", "iif", leg, "lookup", str(DELAY_TABLE), "pref", "200")
            if self.link.mbit > 0:
                _shape(ns, "eth0", self.link.mbit)
                _shape(router, leg, self.link.mbit)
        if delayed:
            log = open(self.log_dir / "delay_line.log", "wb")
            self.delay_proc = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.router,
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "delay-line",
                    "--delay-ms",
                    str(self.link.delay_ms),
                    "--stats",
                    str(self.delay_stats),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            log.close()
            self._wait_delay_line()

    def _wait_delay_line(self, timeout: float = 10.0) -> None:
        """Until a ping-like TCP probe crosses the delay line (the line is attached to the TUN)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.delay_proc.poll() is not None:
                raise RuntimeError(f"the delay line exited: {(self.log_dir / 'delay_line.log').read_text()}")
            if self.delay_stats.with_suffix(".ready").exists():
                return
            time.sleep(0.05)
        raise RuntimeError("the delay line did not start within 10 s")

    def __exit__(self, *exc) -> None:
        if self.delay_proc is not None and self.delay_proc.poll() is None:
            self.delay_proc.send_signal(signal.SIGTERM)
            try:
                self.delay_proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.delay_proc.kill()
                self.delay_proc.wait()
        teardown(self.prefix)

    def delay_report(self) -> dict | None:
        """What the delay line measured (packets, mean and max lateness in ms), once it stopped."""
        if self.delay_stats.exists():
            return json.loads(self.delay_stats.read_text())
        return None

    def run_in(self, i: int, cmd: list[str], **popen) -> subprocess.Popen:
        """``cmd`` as a process inside host ``i``'s namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns(i), *cmd], **popen)


def teardown(prefix: str = PREFIX) -> None:
    """Delete every namespace named ``<prefix>-…`` (their veths and the TUN go with them)."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        if name.startswith(prefix + "-"):
            _ip("netns", "del", name, check=False)


# ---------------------------------------------------------------------------------------------
# The delay line (runs inside the router namespace)

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000


class DelayLine:
    """Every packet read from the TUN device written back ``delay_ms`` later, in order.

    Packets are read as they come (non-blocking, all that is queued) and kept in a FIFO with their due
    time; the loop sleeps in ``poll`` until the next packet is due or a new one arrives. ``lateness``
    records how much later than due each packet left (the emulation's error)."""

    def __init__(self, delay_ms: float, name: str = TUN):
        self.delay = delay_ms / 1000.0
        self.fd = os.open("/dev/net/tun", os.O_RDWR)
        fcntl.ioctl(self.fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
        os.set_blocking(self.fd, False)
        self.packets = 0
        self.late_sum = 0.0
        self.late_max = 0.0
        self.stopped = False

    def run(self) -> None:
        queue: collections.deque = collections.deque()
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        read, write, clock = os.read, os.write, time.monotonic
        while not self.stopped:
            # A bounded sleep when idle, so a stop request is seen within 0.2 s.
            timeout = 200 if not queue else max(0, math.ceil((queue[0][0] - clock()) * 1000))
            try:
                poller.poll(timeout)
            except InterruptedError:
                continue
            now = clock()
            while True:
                try:
                    queue.append((now + self.delay, read(self.fd, 65536)))
                except BlockingIOError:
                    break
            while queue and queue[0][0] <= now:
                due, packet = queue.popleft()
                write(self.fd, packet)
                late = now - due
                self.packets += 1
                self.late_sum += late
                if late > self.late_max:
                    self.late_max = late
                now = clock()

    def stats(self) -> dict:
        return {
            "packets": self.packets,
            "delay_ms": self.delay * 1000,
            "mean_late_ms": 1000 * self.late_sum / max(1, self.packets),
            "max_late_ms": 1000 * self.late_max,
        }


def _delay_line_main(args) -> None:
    line = DelayLine(args.delay_ms)
    try:  # real-time priority: a packet's hold must not stretch when the training processes load the CPU
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (OSError, AttributeError):
        pass

    def stop(*_):
        line.stopped = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    stats = Path(args.stats)
    stats.with_suffix(".ready").write_text("1")
    line.run()
    stats.write_text(json.dumps(line.stats()))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="the WAN bench's delay line (run inside the router namespace)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("delay-line")
    d.add_argument("--delay-ms", type=float, required=True)
    d.add_argument("--stats", required=True)
    _delay_line_main(ap.parse_args())
