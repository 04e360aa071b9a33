"""ddpkit.launchers.network without a network: parsing injected ``ip`` output; reachability on loopback only."""
import errno
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from ddpkit.launchers import network as net
from ddpkit.launchers import watchdog
from ddpkit.base.errors import ConfigError

ROUTE_REMOTE = "10.213.0.1 dev eth0 src 10.213.0.2 uid 0 \\    cache \n"
ROUTE_LOCAL = "local 10.213.0.1 dev lo table local src 10.213.0.1 uid 0 \\    cache <local> \n"
ROUTE_VIA = "192.0.2.9 via 10.0.0.254 dev ens3 src 10.0.0.7 uid 0 \\    cache \n"
ADDRS = """1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever
1: lo    inet6 ::1/128 scope host \\       valid_lft forever preferred_lft forever
7: eth0@if8    inet 10.213.0.1/24 scope global eth0\\       valid_lft forever preferred_lft forever
9: ib0    inet6 fd00::5/64 scope global \\       valid_lft forever preferred_lft forever
"""
PROC_ROUTE = """Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0
eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
ib0\t0000D50A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0
"""


def fake_ip(route_get, addr_show=ADDRS):
    """An ``ip`` runner that answers from canned text and records what it was asked."""
    def run(args):
        run.calls.append(list(args))
        if args[:1] == ["-V"]:
            return "ip utility, iproute2-6.1.0\n"
        if "route" in args:
            return route_get
        if "addr" in args:
            return addr_show
        return None
    run.calls = []
    return run


@pytest.mark.parametrize("endpoint, expected", [
    ("10.0.0.1:29400", ("10.0.0.1", 29400)),
    ("node0", ("node0", 29400)),
    ("node0.cluster:1234", ("node0.cluster", 1234)),
    ("[fe80::1]:1234", ("fe80::1", 1234)),
    ("fe80::1", ("fe80::1", 29400)),
])
def test_split_endpoint(endpoint, expected):
    assert net.split_endpoint(endpoint) == expected


@pytest.mark.parametrize("endpoint", [":29400", "host:http", "host:70000"])
def test_split_endpoint_rejects_nonsense_in_one_line(endpoint):
    with pytest.raises(ConfigError, match="rendezvous endpoint"):
        net.split_endpoint(endpoint)


def test_parse_route_get_remote_local_and_gateway():
    assert net.parse_route_get(ROUTE_REMOTE) == net.Route("eth0", "10.213.0.2", local=False)
    assert net.parse_route_get(ROUTE_LOCAL) == net.Route("lo", "10.213.0.1", local=True)
    assert net.parse_route_get(ROUTE_VIA) == net.Route("ens3", "10.0.0.7", local=False)
    assert net.parse_route_get("") is None
    assert net.parse_route_get("RTNETLINK answers: Network is unreachable") is None


def test_parse_addresses_strips_prefix_and_veth_peer_suffix():
    found = net.parse_addresses(ADDRS)
    assert found == {"lo": ["127.0.0.1", "::1"], "eth0": ["10.213.0.1"], "ib0": ["fd00::5"]}


def test_parse_proc_route_takes_the_longest_prefix():
    assert net.parse_proc_route(PROC_ROUTE, "10.213.4.4") == "ib0"   # 10.213/16
    assert net.parse_proc_route(PROC_ROUTE, "192.0.2.77") == "eth0"  # 192.0.2/24
    assert net.parse_proc_route(PROC_ROUTE, "8.8.8.8") == "eth0"     # default route
    assert net.parse_proc_route(PROC_ROUTE.splitlines()[0], "8.8.8.8") is None


def test_interface_for_a_peer_is_the_routing_interface():
    run = fake_ip(ROUTE_REMOTE)
    assert net.interface_for("10.213.0.1", run=run) == "eth0"
    assert ["-o", "route", "get", "10.213.0.1"] in run.calls


def test_interface_for_our_own_address_is_where_it_lives_not_lo():
    # Node 0 holds the rendezvous address: peers reach it on eth0, never on lo.
    assert net.interface_for("10.213.0.1", run=fake_ip(ROUTE_LOCAL)) == "eth0"
    route = net.route_to("10.213.0.1", run=fake_ip(ROUTE_LOCAL))
    assert route == net.Route("eth0", "10.213.0.1", local=True)


def test_interface_for_without_a_route_is_none():
    assert net.interface_for("10.213.0.1", run=fake_ip("")) is None


def test_interface_for_falls_back_to_proc_net_route_without_ip():
    no_ip = lambda args: None  # noqa: E731
    assert net.interface_for("10.213.4.4", run=no_ip, proc_route=PROC_ROUTE) == "ib0"


def test_interface_for_loopback_on_this_machine():
    assert net.interface_for("127.0.0.1") == "lo"


def test_unresolvable_host_is_one_line():
    with pytest.raises(ConfigError, match="does not resolve"):
        net.resolve("no-such-host.invalid")


def test_is_local_on_loopback_and_on_an_address_that_is_not_ours():
    assert net.is_local("127.0.0.1") and net.is_local("localhost")
    assert not net.is_local("192.0.2.254")  # TEST-NET-1: binding fails, no packet is sent


def test_check_reachable_accepts_a_listener_and_a_refusal_on_loopback():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        net.check_reachable("127.0.0.1", server.getsockname()[1], timeout=5)
        closed = server.getsockname()[1]
    net.check_reachable("127.0.0.1", closed, timeout=5)  # refused: host up, store not yet


def test_check_reachable_retries_then_gives_a_clear_error():
    attempts = []

    def probe(addr, port, seconds):
        attempts.append(seconds)
        return os.strerror(errno.EHOSTUNREACH)

    with pytest.raises(ConfigError) as info:
        net.check_reachable("10.213.0.99", 29400, timeout=1.5, probe=probe)
    message = str(info.value)
    assert message.startswith("rendezvous endpoint 10.213.0.99:29400 is not reachable from this "
                              "node (No route to host")
    assert "\n" not in message and len(attempts) >= 2


def test_check_reachable_gives_up_at_once_without_a_route():
    attempts = []

    def probe(addr, port, seconds):
        attempts.append(seconds)
        return net.NO_ROUTE

    with pytest.raises(ConfigError, match="Network is unreachable"):
        net.check_reachable("10.213.0.99", 29400, timeout=60, probe=probe)
    assert len(attempts) == 1


def test_check_reachable_succeeds_when_the_host_comes_up():
    answers = [os.strerror(errno.EHOSTUNREACH), None]
    net.check_reachable("10.213.0.1", 29400, timeout=10, probe=lambda *a: answers.pop(0))
    assert answers == []


def test_node_network_on_the_rendezvous_host_uses_loopback_only_for_loopback_jobs():
    plan = net.node_network("127.0.0.1:29400")
    assert plan == net.NodeNetwork(iface="lo", local_addr="127.0.0.1", is_host=True)


def test_node_network_keeps_an_explicit_interface():
    plan = net.node_network("127.0.0.1:29400", iface="eth9")
    assert plan.iface == "eth9" and plan.is_host


def test_socket_env():
    assert net.socket_env("eth1") == {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1"}
    assert net.socket_env(None) == {}


def test_torchrun_extra_args_name_the_store_host_and_the_published_address():
    plan = net.NodeNetwork("eth0", "10.213.0.2", is_host=False)
    assert net.torchrun_extra_args(plan) == ["--local-addr", "10.213.0.2",
                                             "--rdzv-conf", "is_host=0"]
    host = net.NodeNetwork("eth0", "10.213.0.1", is_host=True)
    assert net.torchrun_extra_args(host, join_timeout=90) == [
        "--local-addr", "10.213.0.1", "--rdzv-conf", "join_timeout=90,read_timeout=90,is_host=1"]


class RendezvousTimeoutError(Exception):
    """Stands in for torch's class of that name (only the name is looked at)."""


class DistStoreError(Exception):
    pass


def test_rendezvous_failures_become_one_line():
    err = net.rendezvous_failure(RendezvousTimeoutError(), "10.0.0.1:29400", 2, 60)
    assert str(err).startswith("the rendezvous at 10.0.0.1:29400 did not gather 2 nodes within "
                               "60 s: start every node within --rdzv-timeout")
    store = DistStoreError("Timed out after 61 seconds waiting for clients. 1/2 clients joined.")
    err = net.rendezvous_failure(store, "10.0.0.1:29500", 2, 60)
    assert "1/2 clients joined" in str(err) and "--node-rank" in str(err)
    assert net.rendezvous_failure(ValueError("x"), "10.0.0.1:29400", 2, 60) is None


def test_watchdog_exits_once_every_worker_is_an_unreaped_zombie_for_the_grace():
    exited = []
    views = iter([{7: "S"}, {7: "Z"}, {7: "Z"}, {7: "Z"}] + [{7: "Z"}] * 100)
    dog = watchdog.AgentWatchdog("10.0.0.1:29400", grace=0.2, interval=0.05, exit=exited.append,
                                 list_children=lambda: next(views), position=lambda: "store.get")
    with dog:
        deadline = time.monotonic() + 5
        while not exited and time.monotonic() < deadline:
            time.sleep(0.02)
    assert exited == [1]


def test_watchdog_leaves_an_agent_whose_main_thread_moves_then_exits_once_it_stands_still():
    """The agent logging a failed worker imports torch._dynamo and sympy (over 20 s on a loaded
    host): its workers are zombies meanwhile, but it is not stuck."""
    exited, looked, moving = [], [], [True]

    def position():
        looked.append(time.monotonic())
        return len(looked) if moving[0] else "store.get"

    dog = watchdog.AgentWatchdog("10.0.0.1:29400", grace=0.1, interval=0.02, exit=exited.append,
                                 list_children=lambda: {7: "Z"}, position=position)
    with dog:
        deadline = time.monotonic() + 5
        while (len(looked) < 2 or looked[-1] - looked[0] < 0.4) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert exited == [], "an agent that moves was called stuck"
        moving[0] = False
        while not exited and time.monotonic() < deadline:
            time.sleep(0.02)
    assert exited == [1]


def test_the_main_thread_position_is_its_innermost_python_frame():
    seen = []

    def sleeping():
        time.sleep(0.5)  # the line the other thread sees

    t = threading.Timer(0.2, lambda: seen.append(watchdog.main_thread_position()))
    t.start()
    sleeping()
    t.join()
    line = sleeping.__code__.co_firstlineno + 1
    assert seen == [(id(sleeping.__code__), line)]


def test_watchdog_leaves_a_healthy_agent_alone():
    exited, looked = [], []

    def children():   # one worker still running, one a zombie
        looked.append(time.monotonic())
        return {7: "S", 8: "Z"}

    dog = watchdog.AgentWatchdog("10.0.0.1:29400", grace=0.1, interval=0.02, exit=exited.append,
                                 list_children=children)
    with dog:
        deadline = time.monotonic() + 5
        # it looked well past the grace (not: the thread never ran), and left the agent alone
        while (len(looked) < 2 or looked[-1] - looked[0] < 0.3) and time.monotonic() < deadline:
            time.sleep(0.02)
    assert len(looked) >= 2 and looked[-1] - looked[0] >= 0.3, looked
    assert exited == []


def test_children_lists_a_running_child():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        # Alive: running, sleeping, or in disk sleep (a child just started pages its
        # interpreter in: "D" was seen in CI); never a zombie ("Z") or dead ("X").
        assert watchdog.children().get(proc.pid) in ("R", "S", "D")
    finally:
        proc.kill()
        proc.wait()


class FakeStore:
    """The slice of TCPStore that watch_nnodes uses, shared by the "nodes" of a test."""

    def __init__(self):
        self.data = {}

    def compare_set(self, key, expected, desired):
        if key not in self.data and expected == "":
            self.data[key] = desired.encode()
        return self.data[key]

    def set(self, key, value):
        self.data[key] = value.encode()

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


def test_watch_nnodes_stops_both_nodes_when_they_disagree(capfd):
    store, exits = FakeStore(), []
    # no workers yet (this process's own children, e.g. of other tests, must not count)
    first = watchdog.watch_nnodes("10.0.0.1:29400", 2, timeout=5, exit=exits.append,
                             connect=lambda *a: store, list_children=dict)
    second = watchdog.watch_nnodes("10.0.0.1:29400", 3, timeout=5, exit=exits.append,
                              connect=lambda *a: store, list_children=dict)
    first.join(6)
    second.join(6)
    assert exits == [2, 2]
    err = capfd.readouterr().err
    assert ("error: this node was started with --nnodes 3 but another node of the rendezvous at "
            "10.0.0.1:29400 with --nnodes 2: use the same --nnodes on every node") in err
    assert "started with --nnodes 2 but another node" in err and "--nnodes 3:" in err


def test_watch_nnodes_is_quiet_when_nodes_agree_or_the_store_is_unreachable():
    store, exits = FakeStore(), []
    threads = [watchdog.watch_nnodes("h:1", 2, timeout=0.6, exit=exits.append,
                                connect=lambda *a: store, list_children=dict) for _ in range(2)]

    def unreachable(*args):
        raise RuntimeError("connection refused")

    threads.append(watchdog.watch_nnodes("h:1", 2, timeout=0.6, exit=exits.append,
                                    connect=unreachable))
    for t in threads:
        t.join(3)
    assert exits == []


# ----------------------------------------------------------------------------- ddpkit run wiring

@pytest.fixture
def fake_torchrun(monkeypatch, tmp_path):
    """ddpkit.launchers.torchrun.run with torchrun, the --nnodes check and the watchdog replaced; env restored."""
    import torch.distributed.run as trun

    from ddpkit.launchers import torchrun as launchers

    for key in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME",
                "NCCL_SOCKET_IFNAME", launchers.LAUNCHER_PID_VAR):
        monkeypatch.setenv(key, "x")  # remembered, so the test's changes are undone
        monkeypatch.delenv(key)
    seen = {"raise": None}

    def torchrun(args):
        seen.update(args=args, env=dict(os.environ))
        if seen["raise"]:
            raise seen["raise"]

    monkeypatch.setattr(trun, "run", torchrun)
    monkeypatch.setattr(watchdog, "watch_nnodes", lambda *a, **kw: seen.setdefault("watch", (a, kw)))
    monkeypatch.setattr(watchdog, "AgentWatchdog", lambda endpoint: __import__("contextlib").nullcontext())
    script = tmp_path / "train.py"
    script.write_text("")
    seen["script"] = str(script)
    return seen


def _cfg(seen, **kw):
    from ddpkit.launchers.torchrun import RunConfig
    return RunConfig(script=seen["script"], script_args=["--lr", "1"], **kw)


def test_run_on_the_endpoint_host_serves_the_store_with_a_store_per_round(fake_torchrun):
    from ddpkit.launchers.torchrun import LAUNCHER_PID_VAR, RDZV_ENDPOINT_VAR, run

    assert run(_cfg(fake_torchrun, nnodes=2, rdzv_endpoint="127.0.0.1:29411",
                    rdzv_timeout=30)) == 0
    args = fake_torchrun["args"]
    conf = args.rdzv_conf.split(",")
    assert "is_host=1" in conf and "join_timeout=30" in conf
    assert (args.training_script, args.training_script_args) == (fake_torchrun["script"],
                                                                 ["--lr", "1"])
    env = fake_torchrun["env"]
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env[LAUNCHER_PID_VAR] == str(os.getpid())
    assert env[RDZV_ENDPOINT_VAR] == "127.0.0.1:29411"  # ddpkit doctor knows its job's port
    assert LAUNCHER_PID_VAR not in os.environ  # only while torchrun runs
    assert RDZV_ENDPOINT_VAR not in os.environ
    assert fake_torchrun["watch"][0][:2] == ("127.0.0.1:29411", "2")


def test_run_single_node_adds_nothing_and_iface_pins_gloo(fake_torchrun):
    from ddpkit.launchers.torchrun import run

    assert run(_cfg(fake_torchrun, nproc=2, iface="eth7")) == 0
    assert fake_torchrun["args"].rdzv_conf == ""
    assert fake_torchrun["env"]["GLOO_SOCKET_IFNAME"] == "eth7"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in fake_torchrun["env"]
    assert "watch" not in fake_torchrun


def test_run_static_rendezvous_passes_the_timeout_and_reports_a_missing_node(fake_torchrun):
    from ddpkit.launchers.torchrun import run

    fake_torchrun["raise"] = DistStoreError("Timed out after 21 seconds waiting for clients. "
                                            "1/2 clients joined.")
    with pytest.raises(ConfigError, match=r"^the rendezvous at 127.0.0.1:29522 did not gather "
                                          r"2 nodes within 20 s \(Timed out after 21 seconds"):
        run(_cfg(fake_torchrun, nnodes=2, master_addr="127.0.0.1", master_port=29522,
                 node_rank=1, rdzv_timeout=20))
    assert "timeout=20" in fake_torchrun["args"].rdzv_conf


def test_run_c10d_rendezvous_timeout_is_one_line(fake_torchrun):
    from ddpkit.launchers.torchrun import run

    fake_torchrun["raise"] = RendezvousTimeoutError()
    with pytest.raises(ConfigError, match="did not gather 2 nodes within 12 s"):
        run(_cfg(fake_torchrun, nnodes=2, rdzv_endpoint="127.0.0.1:29411", rdzv_timeout=12))
    fake_torchrun["raise"] = ValueError("something else")
    with pytest.raises(ValueError):
        run(_cfg(fake_torchrun, nnodes=2, rdzv_endpoint="127.0.0.1:29411"))


def test_rdzv_timeout_must_be_at_least_a_second(fake_torchrun):
    from ddpkit.launchers.torchrun import run

    with pytest.raises(ConfigError, match="--rdzv-timeout must be >= 1 second, got 0.5"):
        run(_cfg(fake_torchrun, nnodes=2, rdzv_endpoint="127.0.0.1:29411", rdzv_timeout=0.5))
