"""Addresses and routes: which interface and address reach the rendezvous host, is it up, free
ports, and torchrun's rendezvous errors in one line. The watchdogs are in :mod:`.watchdog`.
"""
from __future__ import annotations

import errno
import ipaddress
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..base.errors import ConfigError

__all__ = ["Route", "NodeNetwork", "split_endpoint", "resolve", "parse_route_get",
           "parse_addresses", "parse_proc_route", "route_to", "interface_for", "is_local",
           "check_reachable", "node_network", "socket_env", "torchrun_extra_args",
           "rendezvous_failure", "free_port", "port_in_use"]

#: Runs ``ip ARGS`` and returns its stdout, or None when ``ip`` is missing or fails.
IpRunner = Callable[[Sequence[str]], Optional[str]]


@dataclass(frozen=True)
class Route:
    """How this node reaches an address: the interface, and the source address it uses.

    Example::

        Route(iface="eth0", src="10.0.0.5", local=False)
    """

    iface: str
    src: Optional[str] = None
    local: bool = False  # the address is one of this node's own


def _run_ip(args: Sequence[str]) -> Optional[str]:
    try:
        res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 else None


def split_endpoint(endpoint: str, default_port: int = 29400) -> Tuple[str, int]:
    """``HOST:PORT`` (or ``[v6]:PORT``, or bare ``HOST``) into ``(host, port)``.

    Example::

        split_endpoint("10.0.0.1:29400")   # ('10.0.0.1', 29400)
        split_endpoint("[fe80::1]:1234")   # ('fe80::1', 1234)
    """
    host, sep, port = endpoint.rpartition(":")
    if not sep or (host.count(":") and not host.startswith("[")):
        host, port = endpoint, ""  # bare host, or a bare IPv6 address
    host = host.strip("[]")
    if not host:
        raise ConfigError(f"rendezvous endpoint {endpoint!r} has no host; use HOST:PORT")
    if not port:
        return host, default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"rendezvous endpoint {endpoint!r}: port {port!r} is not 1-65535")
    return host, int(port)


def resolve(host: str) -> str:
    """The IP address ``host`` names (IPv4 preferred); :class:`ConfigError` if it names none.

    Example::

        resolve("localhost")   # '127.0.0.1'
    """
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"rendezvous host {host!r} does not resolve on this node "
                          f"({exc}); use its IP address or fix /etc/hosts / DNS") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])


def wait_resolvable(host: str, timeout: float, say: Callable[[str], None],
                    lookup: Optional[Callable[[str], str]] = None) -> str:
    """Resolve ``host``, waiting up to ``timeout`` s for it to appear: in Kubernetes a pod's
    DNS name (``job-0.svc``) exists only once that pod has started, minutes after the others
    may have. Says once that it waits; a :class:`ConfigError` line if it never resolves.

    Example::

        wait_resolvable("train-0.train", 600, print)   # '10.4.2.17'
    """
    lookup = lookup or resolve
    start, said = time.monotonic(), False
    while True:
        try:
            return lookup(host)
        except ConfigError:
            waited = time.monotonic() - start
            if waited >= timeout:
                raise ConfigError(f"rendezvous host {host!r} did not resolve within "
                                  f"{timeout:.0f} s: its pod never started (kubectl get pods; "
                                  "kubectl describe pod), or the headless Service's name is "
                                  "not the pods' subdomain") from None
            if not said:
                say(f"ddpkit run: waiting up to {timeout:.0f} s for the rendezvous host {host} "
                    "to resolve (its pod has not started yet)")
                said = True
            time.sleep(min(1.0, max(0.05, timeout - waited)))


def parse_route_get(text: str) -> Optional[Route]:
    """The route in ``ip -o route get ADDR`` output, or None if there is none.

    Example::

        parse_route_get("10.0.0.2 dev eth0 src 10.0.0.1 uid 0 \\\\    cache")
        # Route(iface='eth0', src='10.0.0.1', local=False)
    """
    words = text.split()
    if "dev" not in words or words.index("dev") + 1 >= len(words):
        return None
    fields = {key: words[i + 1] for i, key in enumerate(words[:-1]) if key in ("dev", "src")}
    return Route(fields["dev"], fields.get("src"), local=bool(words) and words[0] == "local")


def parse_addresses(text: str) -> Dict[str, List[str]]:
    """Interface -> its addresses, from ``ip -o addr show`` output.

    Example::

        parse_addresses("2: eth0    inet 10.0.0.1/24 brd 10.0.0.255 scope global eth0")
        # {'eth0': ['10.0.0.1']}
    """
    found: Dict[str, List[str]] = {}
    for line in text.splitlines():
        words = line.split()
        for family in ("inet", "inet6"):
            if len(words) > 3 and words[2] == family:
                iface = words[1].split("@")[0]
                found.setdefault(iface, []).append(words[3].split("/")[0])
    return found


def parse_proc_route(text: str, addr: str) -> Optional[str]:
    """The interface of the longest matching IPv4 route to ``addr`` in ``/proc/net/route``.

    For machines without ``ip``; destinations and masks there are little-endian hex.

    Example::

        parse_proc_route(open("/proc/net/route").read(), "10.0.0.2")   # 'eth0'
    """
    target = int(ipaddress.IPv4Address(addr))
    best: Tuple[int, Optional[str]] = (-1, None)
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 8:
            continue
        dest, mask = (int.from_bytes(bytes.fromhex(c), "little") for c in (cols[1], cols[7]))
        prefix = bin(mask).count("1")
        if target & mask == dest and prefix > best[0]:
            best = (prefix, cols[0])
    return best[1]


def _owner(addr: str, run: IpRunner) -> Optional[str]:
    text = run(["-o", "addr", "show"])
    for iface, addrs in parse_addresses(text or "").items():
        if addr in addrs:
            return iface
    return None


def route_to(host: str, run: IpRunner = _run_ip) -> Optional[Route]:
    """How this node reaches ``host`` (``ip route get``), or None if it has no route there.

    For one of this node's own addresses the interface holding it is returned, not ``lo``:
    that is where peers reach us. ``run`` is injectable for tests.

    Example::

        route_to("10.213.0.1")   # Route(iface='eth0', src='10.213.0.2', local=False)
    """
    addr = resolve(host)
    route = parse_route_get(run(["-o", "route", "get", addr]) or "")
    if route is None:
        return None
    if route.local and not ipaddress.ip_address(addr).is_loopback:
        return Route(_owner(addr, run) or route.iface, addr, local=True)
    return route


def interface_for(host: str, run: IpRunner = _run_ip,
                  proc_route: Optional[str] = None) -> Optional[str]:
    """The network interface this node uses to reach ``host`` (None if none routes there).

    Asks ``ip route get``; without ``ip``, falls back to ``/proc/net/route`` (IPv4).

    Example::

        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface_for("10.213.0.1") or "")
    """
    if run(["-V"]) is not None:
        route = route_to(host, run)
        return route.iface if route else None
    addr = resolve(host)
    if ipaddress.ip_address(addr).version != 4:
        return None
    if proc_route is None:
        try:
            with open("/proc/net/route") as f:
                proc_route = f.read()
        except OSError:
            return None
    return parse_proc_route(proc_route, addr)


def is_local(host: str) -> bool:
    """True if ``host`` is one of this node's addresses (binding to it succeeds).

    Example::

        is_local("127.0.0.1")   # True
    """
    addr = resolve(host)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, 0))
        except OSError:
            return False
    return True


# Errors that say the host (not merely the port) cannot be reached: worth a retry, then an error.
_UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT, errno.EHOSTDOWN}
#: No route at all: the routing table will not change while we wait, so fail at once.
NO_ROUTE = os.strerror(errno.ENETUNREACH)


def _probe(addr: str, port: int, timeout: float) -> Optional[str]:
    """None if ``addr`` answered (accepted or refused), else why not."""
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return None
    except ConnectionRefusedError:
        return None  # the host is there; its rendezvous store just is not listening yet
    except socket.timeout:
        return f"no answer within {timeout:.0f} s"
    except OSError as exc:
        if exc.errno not in _UNREACHABLE:
            raise
        return os.strerror(exc.errno)


def check_reachable(host: str, port: int, timeout: float = 30.0,
                    probe: Callable[[str, int, float], Optional[str]] = _probe) -> None:
    """Raise :class:`ConfigError` unless ``host`` answers on ``port`` within ``timeout`` s.

    A refused connection counts as reachable: the host is up and the rendezvous store on it
    may start later (torchrun waits for it). "No route" fails at once: waiting cannot help.
    ``probe(addr, port, seconds)`` is injectable for tests.

    Example::

        check_reachable("10.213.0.1", 29400, timeout=20)
    """
    addr = resolve(host)
    start = time.monotonic()
    while True:
        left = timeout - (time.monotonic() - start)
        why = probe(addr, port, max(0.5, min(5.0, left)))
        if why is None:
            return
        if why == NO_ROUTE or time.monotonic() - start >= timeout:
            raise ConfigError(f"rendezvous endpoint {host}:{port} is not reachable from this "
                              f"node ({why}; tried for {time.monotonic() - start:.0f} s): "
                              "check the address and that node 0 is up")
        time.sleep(min(1.0, max(0.0, timeout - (time.monotonic() - start))))


@dataclass(frozen=True)
class NodeNetwork:
    """What a node needs to take part: the interface and address peers reach it on.

    ``is_host``: this node holds the rendezvous address (it serves the c10d store).

    Example::

        NodeNetwork(iface="eth0", local_addr="10.213.0.2", is_host=False)
    """

    iface: Optional[str]
    local_addr: Optional[str]
    is_host: bool


def node_network(endpoint: str, iface: Optional[str] = None, *, check_timeout: float = 30.0,
                 run: IpRunner = _run_ip) -> NodeNetwork:
    """Work out, and check, this node's side of a multi-node job meeting at ``endpoint``.

    The rendezvous host's node serves the store; every other node first checks it can reach
    it (one clear line in bounded time instead of torchrun's minutes of retries).

    Example::

        net = node_network("10.213.0.1:29400")   # NodeNetwork('eth0', '10.213.0.2', False)
    """
    host, port = split_endpoint(endpoint)
    hosting = is_local(host)
    if not hosting:
        check_reachable(host, port, check_timeout)
    route = route_to(host, run)
    if route is None and not hosting:
        raise ConfigError(f"no network route from this node to the rendezvous host {host}")
    local_addr = route.src if route else None
    chosen = iface or (route.iface if route else None)
    if chosen == "lo" and not ipaddress.ip_address(resolve(host)).is_loopback:
        chosen = None  # never tell gloo to use loopback for a job that spans machines
    return NodeNetwork(chosen, local_addr, hosting)


def socket_env(iface: Optional[str]) -> Dict[str, str]:
    """The variables that pin gloo and NCCL traffic to ``iface`` (empty for None).

    Example::

        os.environ.update(socket_env("eth1"))
    """
    return {"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": iface} if iface else {}


def torchrun_extra_args(plan: NodeNetwork, join_timeout: Optional[float] = None,
                        conf: Optional[Dict[str, Any]] = None) -> List[str]:
    """torchrun flags for a c10d multi-node run: who serves the store, which address to publish.

    ``is_host`` stops torchrun guessing from the hostname (a node whose name resolves to
    127.0.0.1 would otherwise never serve the store); ``--local-addr`` is what rank 0
    publishes as MASTER_ADDR (torchrun's default, the FQDN, is often loopback). With a
    ``join_timeout`` a node also waits at most that long for the store's node to come up;
    ``conf``: more ``--rdzv-conf`` keys (an elastic job's last call and heartbeats).

    Example::

        torchrun_extra_args(NodeNetwork("eth0", "10.0.0.2", False), join_timeout=60)
        # ['--local-addr', '10.0.0.2', '--rdzv-conf', 'join_timeout=60,read_timeout=60,is_host=0']
    """
    args = ["--local-addr", plan.local_addr] if plan.local_addr else []
    keys = [f"join_timeout={int(join_timeout)}", f"read_timeout={int(join_timeout)}"] \
        if join_timeout else []
    keys += [f"{key}={value}" for key, value in (conf or {}).items()]
    return args + ["--rdzv-conf", ",".join(keys + [f"is_host={int(plan.is_host)}"])]


def rendezvous_failure(exc: BaseException, endpoint: str, nnodes: int,
                       timeout: Optional[float]) -> Optional[ConfigError]:
    """A one-line :class:`ConfigError` for torchrun's rendezvous errors (None for others).

    Example::

        except Exception as exc:
            raise rendezvous_failure(exc, "10.0.0.1:29400", 2, 60) or exc
    """
    kind = type(exc).__name__
    waited = f"{timeout:.0f} s" if timeout else "the rendezvous timeout"
    if kind == "RendezvousTimeoutError":
        return ConfigError(f"the rendezvous at {endpoint} did not gather {nnodes} nodes within "
                           f"{waited}: start every node within --rdzv-timeout of the first, "
                           "with the same --nnodes and --rdzv-endpoint")
    if kind == "RendezvousConnectionError":
        return ConfigError(f"lost the rendezvous store at {endpoint} (waited {waited}): its node "
                           "is gone or unreachable, or gave up waiting for this node")
    if kind == "DistStoreError" and "waiting for clients" in str(exc):
        # static rendezvous (--master-addr): "Timed out after N seconds waiting for clients. 1/2
        # clients joined." -- a node is missing, or two nodes claimed the same --node-rank
        return ConfigError(f"the rendezvous at {endpoint} did not gather {nnodes} nodes within "
                           f"{waited} ({str(exc).strip().splitlines()[0]}): start every node "
                           "with its own --node-rank from 0 to --nnodes - 1")
    if kind == "RendezvousClosedError":
        return ConfigError(f"the rendezvous at {endpoint} is closed: the job already ended on "
                           "the other nodes")
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``.

    Example::

        port = free_port()
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """True if ``host:port`` is a local address whose port is taken (False if not local).

    Example::

        if port_in_use("127.0.0.1", 29500): ...
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
        except socket.gaierror:
            return False
    return False
