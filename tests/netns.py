"""K "machines" on one host: network namespaces joined by veth pairs to a bridge, for real TCP.

Each node has its own stack, address, hostname and /etc/hosts; the host's network is untouched.

    with Cluster(2) as c:
        c.start(0, ["python", "-m", "ddpkit", "run", ...]); c.start(1, [...])
        codes = c.wait(timeout=120)

Layout: a dedicated "switch" namespace holds a bridge ``br0``; node ``i`` (namespace
``ddpk-<pid>-<n>-<i>``) has ``eth0`` = ``10.213.0.<i+1>/24`` whose veth peer is the bridge port
``p<i>`` in the switch. Nodes have no default route, so no packet can leave the test subnet.
Everything (processes, namespaces, links, bridge, hosts files) is removed on exit, also on
failure, timeout or KeyboardInterrupt; namespaces left by a killed run are swept on the next one.
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Dict, List, Optional, Sequence, Tuple

__all__ = ["Cluster", "available", "sweep_stale", "wait_for", "SUBNET", "LAUNCH_VARS"]

SUBNET = "10.213.0"
PREFIX = "ddpk"
NETNS_ETC = Path("/etc/netns")
#: Variables a launcher sets; a node must start as a fresh machine would, without ours.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
               "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME",
               "NCCL_SOCKET_IFNAME", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
_counter = itertools.count()
_available: Optional[Tuple[bool, str]] = None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def available() -> Tuple[bool, str]:
    """``(True, "")`` if namespaces can be made here, else ``(False, why)`` for ``pytest.skip``.

    Example::

        ok, why = available()
        pytestmark = pytest.mark.skipif(not ok, reason=why)
    """
    global _available
    if _available is None:
        _available = _probe()
    return _available


def _probe() -> Tuple[bool, str]:
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "network namespaces need root (run the multi-node tests as root, as CI does)"
    for tool in ("ip", "tc", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' is not installed (iproute2 / util-linux)"
    name = f"{PREFIX}-{os.getpid()}-probe"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return False, f"'ip netns add' is not permitted here: {made.stderr.strip()}"
    try:
        veth = _ip("-n", name, "link", "add", "name", "va", "type", "veth", "peer", "name", "vb",
                   check=False)
        if veth.returncode != 0:
            return False, f"veth pairs are not available: {veth.stderr.strip()}"
        bridge = _ip("-n", name, "link", "add", "name", "br0", "type", "bridge", check=False)
        if bridge.returncode != 0:
            return False, f"bridges are not available: {bridge.stderr.strip()}"
    finally:
        _ip("netns", "del", name, check=False)
    return True, ""


def wait_for(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` until it holds; :class:`TimeoutError` naming ``what`` after ``timeout`` s.

    Example::

        wait_for(lambda: os.path.exists(path), 30, "the checkpoint")
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout} s")
        time.sleep(0.1)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ns_pids(ns: str) -> List[int]:
    res = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in res.stdout.split()] if res.returncode == 0 else []


def _delete_ns(ns: str) -> None:
    # A live process keeps a namespace (and its links) alive after its name is gone: kill first.
    for _ in range(50):
        pids = _ns_pids(ns)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def sweep_stale() -> List[str]:
    """Remove namespaces that a harness in a process that no longer exists left behind.

    Example::

        sweep_stale()   # ['ddpk-4242-0-sw', 'ddpk-4242-0-0', ...]
    """
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    names = [line.split()[0] for line in listed if line.strip()]
    stale = [n for n in names
             if (m := re.fullmatch(rf"{PREFIX}-(\d+)-.+", n)) and not _pid_alive(int(m.group(1)))]
    for name in stale:
        _delete_ns(name)
    return stale


class Cluster:
    """``nodes`` namespaces on one bridge; start commands in them, shape or cut their links.

    ``hostnames=True`` gives every node its own hostname resolving to its own address on every
    node (as DNS does on a real cluster); with ``False`` all nodes share the host's name, which
    resolves to 127.0.0.1 here, the classic misconfigured-cluster case.

    Example::

        with Cluster(2, workdir=tmp_path) as c:
            c.start(0, ["python", "-c", "print('hello from', 0)"])
            assert c.wait(timeout=30) == [0]
    """

    def __init__(self, nodes: int, workdir: Optional[os.PathLike] = None,
                 hostnames: bool = True) -> None:
        if not 1 <= nodes <= 200:
            raise ValueError(f"nodes must be 1..200, got {nodes}")
        self.nodes, self.hostnames = nodes, hostnames
        self.tag = f"{PREFIX}-{os.getpid()}-{next(_counter)}"
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=self.tag + "-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.procs: Dict[int, subprocess.Popen] = {}
        self._created: List[str] = []
        self._pumps: Dict[int, List[threading.Thread]] = {}
        #: (monotonic time, node, line) of everything the nodes printed, in arrival order.
        self.lines: List[Tuple[float, int, str]] = []

    # ------------------------------------------------------------------ names
    def ns(self, node: int) -> str:
        """Namespace name of ``node``."""
        return f"{self.tag}-{node}"

    @property
    def switch(self) -> str:
        """Namespace holding the bridge."""
        return f"{self.tag}-sw"

    def ip(self, node: int) -> str:
        """IPv4 address of ``node`` (``10.213.0.<node+1>``)."""
        return f"{SUBNET}.{node + 1}"

    def hostname(self, node: int) -> str:
        """Hostname of ``node`` (with ``hostnames=True``)."""
        return f"node{node}-{self.tag}"

    #: The node's interface to the bridge, as it is named inside the node.
    iface = "eth0"

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> "Cluster":
        ok, why = available()
        if not ok:
            self.close()  # the temporary workdir
            raise RuntimeError(why)
        sweep_stale()
        atexit.register(self.close)  # even if the with-block's process is torn down oddly
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        self._add_ns(self.switch)
        _ip("-n", self.switch, "link", "add", "name", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns = self._add_ns(self.ns(i))
            _ip("-n", ns, "link", "add", "name", self.iface, "type", "veth",
                "peer", "name", f"p{i}", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", self.iface)
            _ip("-n", ns, "link", "set", self.iface, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if self.hostnames:
                self._write_hosts(ns)

    def _add_ns(self, name: str) -> str:
        _ip("netns", "add", name)
        self._created.append(name)
        return name

    def _write_hosts(self, ns: str) -> None:
        # `ip netns exec` bind-mounts /etc/netns/NS/* over /etc/*: a per-node /etc/hosts.
        lines = ["127.0.0.1 localhost"] + [f"{self.ip(j)} {self.hostname(j)}"
                                           for j in range(self.nodes)]
        (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
        (NETNS_ETC / ns / "hosts").write_text("\n".join(lines) + "\n")
        # No name server: a lookup that misses /etc/hosts fails at once instead of timing out.
        (NETNS_ETC / ns / "resolv.conf").write_text("# ddpkit test node: /etc/hosts only\n")

    def close(self) -> None:
        """Kill everything started here and remove namespaces, links, bridge and hosts files."""
        for proc in self.procs.values():
            _killpg(proc)
        for name in reversed(self._created):
            _delete_ns(name)
        self._created.clear()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for pumps in self._pumps.values():
            for pump in pumps:
                pump.join(timeout=5)
        atexit.unregister(self.close)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ------------------------------------------------------------------ processes
    def command(self, node: int, argv: Sequence[str]) -> List[str]:
        """``argv`` wrapped to run inside ``node`` (its namespace, and its own hostname)."""
        wrapped = ["ip", "netns", "exec", self.ns(node)]
        if self.hostnames:
            # A private UTS namespace so `hostname` differs per node; exec keeps one pid.
            wrapped += ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                        self.hostname(node)]
        return wrapped + list(argv)

    def start(self, node: int, argv: Sequence[str], env: Optional[Dict[str, str]] = None,
              cwd: Optional[os.PathLike] = None) -> subprocess.Popen:
        """Start ``argv`` in ``node``; its stdout/stderr go to ``workdir/node<i>.out|.err``.

        ``env`` is added to the caller's environment less launcher variables.

        Example::

            c.start(1, [sys.executable, "-m", "ddpkit", "run", "--nnodes", "2", ...])
        """
        if node in self.procs and self.procs[node].poll() is None:
            raise RuntimeError(f"node {node} is still running a command")
        clean = {k: v for k, v in os.environ.items()
                 if k not in LAUNCH_VARS and not k.startswith(("TORCHELASTIC_", "SLURM_", "PET_"))}
        clean.update({"PYTHONUNBUFFERED": "1", **(env or {})})
        proc = subprocess.Popen(self.command(node, argv), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=clean, cwd=cwd,
                                start_new_session=True)
        self.procs[node] = proc
        for stream in ("out", "err"):
            pump = threading.Thread(target=self._pump, daemon=True,
                                    args=(node, stream, getattr(proc, "std" + stream)))
            pump.start()
            self._pumps.setdefault(node, []).append(pump)
        return proc

    def _pump(self, node: int, stream: str, pipe: IO[bytes]) -> None:
        # Copy line by line, noting when each arrived: tests bound how fast errors show up.
        with pipe, open(self.log_path(node, stream), "ab") as f:
            for raw in iter(pipe.readline, b""):
                f.write(raw)
                f.flush()
                self.lines.append((time.monotonic(), node, raw.decode(errors="replace")))

    def first(self, node: int, text: str) -> Optional[float]:
        """``time.monotonic()`` when ``node`` first printed a line containing ``text``, or None.

        Example::

            t = c.first(0, "Timed out")
        """
        return next((t for t, n, line in list(self.lines) if n == node and text in line), None)

    def log_path(self, node: int, stream: str = "err") -> Path:
        """Where ``node``'s ``out`` or ``err`` stream is collected."""
        return self.workdir / f"node{node}.{stream}"

    def output(self, node: int) -> str:
        """Everything ``node`` printed so far, stdout then stderr."""
        parts = [self.log_path(node, s) for s in ("out", "err")]
        return "".join(p.read_text(errors="replace") for p in parts if p.exists())

    def wait(self, timeout: float, nodes: Optional[Sequence[int]] = None) -> List[int]:
        """Exit codes of ``nodes`` (default all started), in order; past ``timeout`` s everything
        is killed and :class:`TimeoutError` raised with each node's last lines.

        Example::

            assert c.wait(timeout=120) == [0, 0]
        """
        chosen = sorted(self.procs) if nodes is None else list(nodes)
        deadline = time.monotonic() + timeout
        while any(self.procs[i].poll() is None for i in chosen):
            if time.monotonic() > deadline:
                running = [i for i in chosen if self.procs[i].poll() is None]
                alive = self.ps()  # before the kill: which process of which node was stuck
                self.kill_all()
                raise TimeoutError(f"nodes {running} still running after {timeout:.0f} s "
                                   f"(all killed)\n{alive}\n{self.tails()}")
            time.sleep(0.1)
        for i in chosen:
            for pump in self._pumps.get(i, []):
                pump.join(timeout=2)  # the last lines, unless an orphan still holds the pipe
        return [self.procs[i].returncode for i in chosen]

    def ps(self) -> str:
        """Every process in every node: pid, state letter and command line (for diagnostics)."""
        rows = []
        for i in range(self.nodes):
            for pid in _ns_pids(self.ns(i)):
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        state = f.read().rsplit(")", 1)[1].split()[0]
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                rows.append(f"node {i} pid {pid} {state} {cmd[:160]}")
        return "--- processes:\n" + "\n".join(rows)

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        """:func:`wait_for`, and past ``timeout`` s (or once every node's command has ended
        without it) a :class:`TimeoutError` that also holds every node's last lines, processes
        and Python stacks: what the cluster was doing instead.

        Example::

            c.wait_for(lambda: "joined" in c.output(0), 60, "the group")
        """
        def held_or_over() -> bool:
            if predicate():
                return True
            if self.procs and all(p.poll() is not None for p in self.procs.values()):
                raise TimeoutError(f"{what} did not happen: every node's command has ended")
            return False

        try:
            wait_for(held_or_over, timeout, what)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{self.tails(30)}\n{self.ps()}\n{self.stacks()}") from None

    def stacks(self) -> str:
        """The Python stack of every thread of every process in every node (``py-spy dump``),
        for diagnostics; says so where py-spy is missing or cannot read a process."""
        spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        if not os.path.exists(spy):
            return "--- stacks: py-spy is not installed"
        dumps = []
        for i in range(self.nodes):
            for pid in _ns_pids(self.ns(i)):
                try:
                    res = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True,
                                         text=True, timeout=30)
                    text = (res.stdout or res.stderr).strip()
                except (OSError, subprocess.TimeoutExpired) as exc:
                    text = f"py-spy: {exc}"
                dumps.append(f"--- node {i} pid {pid}:\n{text}")
        return "\n".join(dumps)

    def tails(self, lines: int = 15) -> str:
        """The last lines of every node's output, for assertion messages."""
        return "\n".join(f"--- node {i}:\n" + "\n".join(self.output(i).splitlines()[-lines:])
                         for i in sorted(self.procs))

    def kill(self, node: int, sig: int = signal.SIGKILL, timeout: float = 30.0) -> None:
        """Send ``sig`` to every process in ``node`` (launcher and the workers it started in
        their own sessions): a machine that dies.

        SIGKILL returns once the node has no process left and the command started in it has
        been reaped (a signal is only queued by ``kill(2)``, and a process forked while the
        node's processes were listed would have missed it); :class:`TimeoutError` past
        ``timeout`` s. Other signals return at once.
        """
        deadline = time.monotonic() + timeout
        while True:
            pids = _ns_pids(self.ns(node))
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            proc = self.procs.get(node)
            if sig != signal.SIGKILL or (not pids and (proc is None or proc.poll() is not None)):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {node} still has processes {timeout:.0f} s after "
                                   f"SIGKILL\n{self.ps()}")
            time.sleep(0.05)

    def kill_all(self) -> None:
        """SIGKILL every process in every node (best effort: a node that outlives it is left
        for :meth:`close`)."""
        for i in range(self.nodes):
            with contextlib.suppress(TimeoutError):
                self.kill(i, timeout=10)

    # ------------------------------------------------------------------ links
    def link_down(self, node: int) -> None:
        """Pull ``node``'s cable: its bridge port goes down; the node itself still runs."""
        _ip("-n", self.switch, "link", "set", f"p{node}", "down")

    def link_up(self, node: int) -> None:
        """Plug ``node``'s cable back in."""
        _ip("-n", self.switch, "link", "set", f"p{node}", "up")

    def shape(self, node: int, rate: Optional[str], strict: bool = False,
              bucket: Optional[int] = None, packet: int = 0, mtu: int = 0) -> None:
        """Limit ``node``'s link to ``rate`` (tc syntax: ``100mbit``, ``1gbit``) both ways with
        tbf (egress of the node's eth0 and of its bridge port); ``None`` removes the limit.

        The default bucket holds 64 KB at least (one GSO packet), so a message that size passes
        at veth speed after an idle moment. ``strict`` caps packets at one Ethernet frame
        (``gso_max_size``) and the bucket at 2 frames or 1 ms of traffic: every byte waits its
        turn, as on a real link of that rate (more packets: more CPU at high rates; the packet
        cap stays after the limit is removed). ``bucket`` sets the bucket's bytes instead (with
        ``strict``, at least one frame: tbf drops a packet larger than its bucket). ``packet``
        caps packets at that many bytes instead of one frame (``strict`` only): at 1 Gbit/s
        one-frame packets cost more CPU than 2 cores have, and a bucket of one 16 KB packet
        charges a 123 KB gradient's bytes where tbf's default 500 KB let it pass at veth speed.
        ``mtu`` sets the link's MTU (both ends of the node's cable): with smaller frames less of
        a message passes free in the bucket's one packet. ``bucket`` must hold one ``packet``
        (and its header); the MTU, like the packet cap, stays after the limit is removed.

        Example::

            c.shape(0, "1gbit"); c.shape(1, "1gbit")
        """
        for ns, dev in ((self.ns(node), self.iface), (self.switch, f"p{node}")):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True, timeout=30)
            if mtu:
                _ip("-n", ns, "link", "set", "dev", dev, "mtu", str(mtu))
            if strict:
                _ip("-n", ns, "link", "set", "dev", dev, "gso_max_size", str(packet or FRAME))
            if rate is not None:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev,
                                "root", "tbf", "rate", rate, "burst",
                                str(bucket) if bucket else _burst(rate, strict),
                                "latency", "100ms" if not strict else "400ms"],
                               check=True, capture_output=True, timeout=30)


#: One Ethernet frame's payload.
FRAME = 1500


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate (``10mbit``, ``1gbit``, ``500kbit``)."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]*)", rate.lower())
    if not m or m.group(2) not in units:
        raise ValueError(f"rate {rate!r}: use a number with kbit, mbit or gbit")
    return float(m.group(1)) * units[m.group(2)]


def _burst(rate: str, strict: bool = False) -> str:
    """Bucket size: 4 ms of traffic (at least 64 KB: one GSO packet), so tbf holds the rate at
    any HZ; ``strict``: 1 ms of traffic, at least 2 frames (packets are one frame then)."""
    bits = rate_bits(rate)
    if strict:
        return str(max(2 * (FRAME + 14), int(bits / 8 * 0.001)))
    return str(max(64 * 1024, int(bits / 8 * 0.004)))


def _killpg(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
