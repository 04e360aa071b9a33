"""Elastic membership (``--nnodes MIN:MAX``) without processes: the flags, what torchrun is
given, and every line a user reads when a node leaves or joins. The nodes themselves:
the elastic scenarios of tests/test_multinode.py."""
import json
import os

import pytest
from torch import nn

from ddpkit.cli.flags import parse_nnodes
from ddpkit.faults.crash import PEER_LOSS_SUFFIX, note_peer_loss
from ddpkit.base.errors import ConfigError
from ddpkit.job.check import check_every_world
from ddpkit.job.config import TrainConfig
from ddpkit.launchers import elastic
from ddpkit.launchers.restarts import _peer_loss, _stopped_with_group
from ddpkit.launchers.torchrun import RunConfig
from ddpkit.checkpoint.advice import cadence_line, grace_line, restarts_allowed, world_change_line

from test_launch_network import _cfg, fake_torchrun  # noqa: F401 (a fixture)


@pytest.mark.parametrize("text, expected", [("3", (None, 3)), ("2:3", (2, 3)), (" 1:1 ", (None, 1)),
                                            (2, (None, 2))])
def test_nnodes_is_a_count_or_a_range(text, expected):
    assert parse_nnodes(text) == expected


@pytest.mark.parametrize("text, message", [("3:2", "MIN (3) is larger than MAX (2)"),
                                           ("0:2", "must be >= 1"), ("2:x", "MIN:MAX"),
                                           ("", "MIN:MAX")])
def test_a_bad_range_is_one_line(text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_nnodes(text)


def test_only_a_range_with_room_is_elastic_and_it_restarts_by_default():
    assert not RunConfig("t.py", nnodes=2).elastic and RunConfig("t.py", nnodes=2).restarts == 0
    assert not RunConfig("t.py", nnodes=2, min_nodes=2).elastic
    grows = RunConfig("t.py", nnodes=3, min_nodes=2)
    assert grows.elastic and grows.restarts == 10 and grows.nnodes_spec == "2:3"
    assert RunConfig("t.py", nnodes=3, min_nodes=2, max_restarts=0).restarts == 0


def test_an_elastic_run_gives_torchrun_the_range_last_call_and_heartbeats(fake_torchrun):
    from ddpkit.launchers.torchrun import run

    assert run(_cfg(fake_torchrun, nnodes=3, min_nodes=2, rdzv_endpoint="127.0.0.1:29411",
                    rdzv_last_call=3.0)) == 0
    args = fake_torchrun["args"]
    assert args.nnodes == "2:3" and args.max_restarts == 10 and args.rdzv_backend == "c10d"
    conf = args.rdzv_conf.split(",")
    assert {"last_call_timeout=3", "keep_alive_interval=2", "keep_alive_max_attempt=3"} <= set(conf)
    # Every node's range is checked against the first node's (nodes that disagree stop).
    assert fake_torchrun["watch"][0][:2] == ("127.0.0.1:29411", "2:3")


def test_an_elastic_run_defaults_the_last_call(fake_torchrun):
    from ddpkit.launchers.torchrun import run

    run(_cfg(fake_torchrun, nnodes=4, min_nodes=1, rdzv_endpoint="127.0.0.1:29411"))
    assert "last_call_timeout=10" in fake_torchrun["args"].rdzv_conf.split(",")


def test_a_fixed_size_run_with_restarts_drops_a_gone_node_after_three_heartbeats(fake_torchrun):
    """A pod evicted, a node crashed: its replacement's round must not wait torch's 3 x 5 s for
    the old one's heartbeat to expire (measured: 15 s of a 17 s recovery)."""
    from ddpkit.launchers.torchrun import run

    run(_cfg(fake_torchrun, nnodes=2, max_restarts=3, rdzv_endpoint="127.0.0.1:29411"))
    conf = fake_torchrun["args"].rdzv_conf.split(",")
    assert {"keep_alive_interval=2", "keep_alive_max_attempt=3"} <= set(conf)
    assert not any(c.startswith("last_call_timeout") for c in conf)   # a fixed size: no wait
    run(_cfg(fake_torchrun, nnodes=2, rdzv_endpoint="127.0.0.1:29411"))
    assert "keep_alive" not in fake_torchrun["args"].rdzv_conf


def test_membership_lines_name_who_left_and_who_joined():
    assert elastic.membership_line(None, ["a", "b", "c"], "2:3") == \
        "3 nodes joined (--nnodes 2:3): a, b, c"
    assert elastic.membership_line(["a", "b", "c"], ["a", "b"], "2:3") == \
        "node c left; 2 nodes go on (a, b) of --nnodes 2:3"
    assert elastic.membership_line(["a", "b"], ["a", "b", "c"], "2:3") == \
        "node c joined; 3 nodes go on (a, b, c) of --nnodes 2:3"
    assert elastic.membership_line(["a", "b"], ["a"], "1:2").startswith("node b left; 1 node goes on")
    assert elastic.membership_line(["a", "b", "c"], ["a", "d"], "1:3") == \
        "nodes b, c left; node d joined; 2 nodes go on (a, d) of --nnodes 1:3"


def test_too_few_nodes_names_the_ones_that_did_not_come_back():
    line = elastic.missing_line(["a", "b", "c"], "a", "2:3")
    assert line.startswith("the last group was a, b, c: fewer than 2 of them came back (this "
                           "node is a; need 2 of --nnodes 2:3); its checkpoints are intact")
    assert elastic.missing_line(None, "a", "2:3") == "need 2 of --nnodes 2:3"


class _Store:
    """A stand-in for a rendezvous round's store (set, check, get)."""

    def __init__(self, preset):
        self.data = {k: json.dumps(v).encode() for k, v in preset.items()}

    def set(self, key, value):
        self.data[key] = value.encode()

    def check(self, keys):
        assert all(k in self.data for k in keys)  # the rounds above are complete
        return True

    def get(self, key):
        return self.data[key]


def test_each_round_the_first_node_says_how_membership_changed(monkeypatch, capsys):
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    # This node is "a"; each round: the others' (name, previous group), a's group rank, size.
    rounds = [({"ddpkit/member/1": ["b", None], "ddpkit/member/2": ["c", None]}, 0, 3),
              ({"ddpkit/member/1": ["b", ["a", "b", "c"]]}, 0, 2),
              ({"ddpkit/member/1": ["b", ["a", "b"]]}, 0, 2),   # the same nodes: no line
              ({"ddpkit/member/0": ["d", None]}, 1, 2),          # a newcomer ranks first
              ({"ddpkit/member/1": ["e", None]}, 1, 2)]          # "a" not the first with history

    def fake_rendezvous(agent, group):
        preset, rank, size = rounds.pop(0)
        if rank == 1 and "ddpkit/member/1" in preset:  # someone else tells: "a" is rank 1
            preset = {"ddpkit/member/0": ["d", ["d", "a"]], **preset}
            preset.pop("ddpkit/member/1")
            preset["ddpkit/member/2"] = ["e", None]
            size = 3
        group.store, group.group_rank, group.group_world_size = _Store(preset), rank, size

    monkeypatch.setattr(SimpleElasticAgent, "_rendezvous", fake_rendezvous)
    monkeypatch.setattr(elastic, "_node_name", lambda addr: "a")
    group = type("Group", (), {})()
    with elastic.tracking_members("2:3") as members:
        for _ in range(5):
            SimpleElasticAgent._rendezvous(None, group)
    assert SimpleElasticAgent._rendezvous is fake_rendezvous  # put back
    assert members.last == ["d", "a", "e"]
    assert capsys.readouterr().err.splitlines() == [
        "ddpkit run: 3 nodes joined (--nnodes 2:3): a, b, c",
        "ddpkit run: node c left; 2 nodes go on (a, b) of --nnodes 2:3",
        # the newcomer d (rank 0) knows nothing; a, the first with a past group, says it
        "ddpkit run: node b left; node d joined; 2 nodes go on (d, a) of --nnodes 2:3"]


def _store_server():
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False)


def test_waiting_for_the_members_names_leaves_the_rendezvous_client_free():
    """The round's store shares its TCP client with the rendezvous heartbeats: while a name is
    missing, another request on that client is answered at once (a store.wait held it for
    the whole wait, and the node's heartbeats stopped)."""
    import threading
    import time
    from datetime import timedelta
    from types import SimpleNamespace

    from torch.distributed import PrefixStore, TCPStore

    server = _store_server()
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
    group = SimpleNamespace(store=PrefixStore("round0", client), group_rank=0, group_world_size=2)
    said = []
    naming = threading.Thread(target=lambda: said.append(elastic._members(group, "a", None, 60)))
    naming.start()
    time.sleep(1.0)  # the wait for node b's name is on
    began = time.monotonic()
    client.set("heartbeat", "now")  # the rendezvous' own request
    took = time.monotonic() - began
    # answered during the wait, not after it: node b's name is not there yet (it is set only
    # below), so a wait that held the client would have ended first (timed out, said empty)
    waiting = naming.is_alive() and not said
    PrefixStore("round0", server).set("ddpkit/member/1", json.dumps(["b", None]))
    naming.join(30)
    assert said == [[["a", None], ["b", None]]]
    assert waiting, f"a request on the rendezvous client waited {took:.1f} s, until the wait ended"


def test_a_stranded_node_counts_as_waiting_and_the_group_takes_it_in(monkeypatch):
    """Nodes a and b train in round 0; both stop heartbeating for a while (a loaded machine),
    so the rendezvous drops them; node c, arriving then, opens round 1 alone, in no wait list.
    torchrun's count of waiting nodes stays 0 and c would wait out its join timeout; counted
    as waiting, the group restarts and the next round has all three."""
    import threading
    import time
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler, RendezvousTimeout)

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as ddpkit run sets it
    server = _store_server()

    def node(name, attempts):
        store = TCPStore("127.0.0.1", server.port, is_master=False, multi_tenant=True,
                         timeout=timedelta(seconds=30))
        return DynamicRendezvousHandler.from_backend(
            "job", store, C10dRendezvousBackend(store, "job"), 2, 3, local_addr=name,
            timeout=RendezvousTimeout(join=timedelta(seconds=60),
                                      last_call=timedelta(seconds=1)),
            keep_alive_interval=1, keep_alive_max_attempt=attempts)

    def join_all(nodes):
        sizes = {}
        threads = [threading.Thread(target=lambda n=n: sizes.update(
            {n: n.next_rendezvous().world_size})) for n in nodes]
        for t in threads:
            t.start()
        return threads, sizes

    # A node drops the others whose last heartbeat is older than its own tolerance: a and b
    # tolerate a minute (beside the whole suite on 2 cores a heartbeat came 2 s late, and a
    # dropped b while both still joined round 0), c 5 s, so c alone drops a and b, when they
    # have stopped heartbeating for 7 s on purpose.
    a, b, c = node("a", 60), node("b", 60), node("c", 5)
    plain = DynamicRendezvousHandler.num_nodes_waiting
    with elastic.counting_stranded_nodes():
        threads, sizes = join_all([a, b])
        for t in threads:
            t.join(60)
        assert sizes == {a: 2, b: 2}
        a._stop_heartbeats(), b._stop_heartbeats()  # starved: no heartbeat for > 5 x 1 s
        time.sleep(7)
        late, joined = join_all([c])
        deadline = time.monotonic() + 30
        while a.num_nodes_waiting() == 0:
            assert time.monotonic() < deadline, "node c was never seen"
            time.sleep(0.2)
        state = a._state_holder.state
        assert (state.round, state.complete, len(state.wait_list)) == (1, False, 0)
        assert plain(a) == 0 and a.num_nodes_waiting() == 1  # torchrun's count misses it
        threads, sizes = join_all([a, b])  # the group restarts
        for t in threads + late:
            t.join(60)
        assert {**sizes, **joined} == {a: 3, b: 3, c: 3}
        for n in (a, b, c):
            n.shutdown()
    assert DynamicRendezvousHandler.num_nodes_waiting is plain  # put back

# gloo's words for a lost peer: it closed its socket; its host reset the connection (a killed
# node: the survivors see this one); the same over IPv6.
GLOO_LOSSES = {
    "10.213.0.3": "[pair.cc:598] Connection closed by peer [10.213.0.3]:1968",
    "10.213.0.2": "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read "
                  "error [10.213.0.2]:54509: Connection reset by peer. This is typically caused "
                  "by a remote worker hanging or bugs in the application.",
    "fd00::3": "[pair.cc:537] Read error [fd00::3]:40112: Connection reset by peer.",
}


@pytest.mark.parametrize("peer, message", GLOO_LOSSES.items(), ids=GLOO_LOSSES.keys())
def test_each_way_gloo_names_a_lost_peer_gives_its_address(tmp_path, monkeypatch, peer, message):
    error_file = str(tmp_path / "error.json")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", error_file)
    note_peer_loss(RuntimeError(message), type("Progress", (), {"last_step": 3})())
    assert json.load(open(error_file + PEER_LOSS_SUFFIX)) == {"step": 3, "peer": peer}


def test_a_rank_that_lost_a_peer_leaves_the_step_and_address_for_the_restart_line(tmp_path,
                                                                                 monkeypatch):
    error_file = str(tmp_path / "error.json")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", error_file)
    progress = type("Progress", (), {"last_step": 17})()
    note_peer_loss(RuntimeError(GLOO_LOSSES["10.213.0.3"]), progress)
    assert json.load(open(error_file + PEER_LOSS_SUFFIX)) == {"step": 17, "peer": "10.213.0.3"}
    failure = type("Failure", (), {"error_file_data": {"message": "<NONE>"}, "exitcode": 1})()
    assert _peer_loss(failure, error_file) == (
        "lost a peer at 10.213.0.3 after step 17 (exit code 1): a node is gone or cut off, or a "
        "process on it died")
    # A rank that failed on its own error is named by that error, not as a lost peer.
    failure.error_file_data = {"message": {"message": "ValueError: x"}}
    assert _peer_loss(failure, error_file) is None
    assert _peer_loss(failure, None) is None


def test_a_rank_that_stopped_with_the_group_is_not_blamed_for_a_lost_peer():
    """An eviction on another node: the ranks there got SIGTERM, every rank saved and left with
    143; the agent here got no signal and restarts its rank."""
    failure = type("Failure", (), {"error_file_data": {"message": "<NONE>"}, "exitcode": 143})()
    assert _stopped_with_group(failure) == (
        "stopped with the group (exit code 143): SIGTERM reached a rank on another node (an "
        "eviction, a preemption) and every rank saved a checkpoint")
    failure.exitcode = 1
    assert _stopped_with_group(failure) is None
    failure.exitcode, failure.error_file_data = 143, {"message": {"message": "ValueError: x"}}
    assert _stopped_with_group(failure) is None   # its own error: named by it


def test_a_resume_on_another_world_size_says_how_the_global_batch_is_split():
    loader = type("Loader", (), {"batch_size": 6})()
    line = world_change_line(3, 2, 14, loader, nn.Linear(2, 2))
    assert line == ("resumed at step 14 on 2 processes (the checkpoint was written by 3); each "
                    "batch still spans 12 samples: 6 a rank, was 4; the epoch goes on with every "
                    "sample once; each rank's random stream starts afresh")
    assert world_change_line(3, 2, 14, loader, saved_batch=12) == line


def test_a_resume_with_another_global_batch_says_both():
    # once: "each batch still spans 18 samples: 6 a rank, was 9" when it had been 16 and 8
    loader = type("Loader", (), {"batch_size": 6})()
    line = world_change_line(2, 3, 9, loader, saved_batch=16)
    assert "each batch now spans 18 samples (6 a rank), was 16 (8 a rank)" in line


def test_a_resume_on_another_world_size_warns_about_batchnorm():
    model = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4))
    assert "warning: 2 BatchNorm layers normalise each rank's batch alone" in \
        world_change_line(2, 3, 5, None, model)
    assert "BatchNorm" not in world_change_line(2, 3, 5, None, model.eval())


def test_the_cadence_line_says_half_the_interval_and_the_save_time():
    assert cadence_line(0, 5.0, 0.2, 0.4) == (
        "checkpoints every 5 min: a failure loses 2.5 min of work on average, plus the restart; "
        "a checkpoint took 0.40 s to save (0.1% of the interval)")
    # Both set: the shorter interval decides.
    assert cadence_line(100, 5.0, 0.5, 0.1).startswith("checkpoints every 100 steps: a failure "
                                                       "loses 25.0 s of work")
    assert "only epoch ends save" in cadence_line(0, 0.0, 0.5, 0.1)
    assert restarts_allowed({"TORCHELASTIC_MAX_RESTARTS": "3"})
    assert not restarts_allowed({}) and not restarts_allowed({"TORCHELASTIC_MAX_RESTARTS": "x"})


def test_the_grace_line_warns_when_a_stop_cannot_end_in_a_checkpoint():
    window = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "30"}
    # a stop finishes the step under way and the next, then saves: 2 x 10 s + 8 s = 28 s fits
    assert grace_line(10.0, 8.0, window) is None
    line = grace_line(20.0, 15.0, window)
    assert "\n" not in line and line.startswith(
        "warning: a stop (SIGTERM: an eviction, a preemption) needs up to 55.0 s here")
    assert "the launcher kills the workers 30 s after it" in line
    assert "ddpkit k8s --grace-period 120" in line and "ddpkit slurm --requeue-grace 140" in line
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=110 for ddpkit run" in line
    # no window set: torchrun's agent waits 30 s; no launcher at all: nothing kills the workers
    assert "kills the workers 30 s after it (torchrun's default" in grace_line(
        20.0, 15.0, {"TORCHELASTIC_RUN_ID": "job"})
    assert grace_line(20.0, 15.0, {}) is None
    assert grace_line(20.0, 15.0, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"}) is None
    # the docs' page on failures and preemption shows this very line
    page = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "docs", "failures.md")
    with open(page) as f:
        assert line in f.read().splitlines()


def test_an_elastic_job_checks_its_global_batch_on_every_node_count():
    check_every_world(TrainConfig(batch_size=12), nproc=1, least=2, most=3)
    check_every_world(TrainConfig(batch_size=24, accum_steps=2), nproc=2, least=2, most=3)
    with pytest.raises(ConfigError, match="--nnodes 2:4: on 3 nodes --batch-size 32 cannot be "
                                          "split evenly over 6 processes; use a --batch-size "
                                          "every node count splits: 24 or 48"):
        check_every_world(TrainConfig(batch_size=32), nproc=2, least=2, most=4)
    with pytest.raises(ConfigError, match="no batch size fits every node count with this data: "
                                          "narrow the range"):
        check_every_world(TrainConfig(batch_size=256), nproc=8, least=1, most=8, samples=1797)
    with pytest.raises(ConfigError, match="--nnodes 1:2: on 2 nodes the 3 training samples"):
        check_every_world(TrainConfig(batch_size=2), nproc=2, least=1, most=2, samples=3)


def test_an_elastic_job_resumes_even_without_restarts(monkeypatch, tmp_path):
    """torchrun restarts healthy workers to grow the group whatever --max-restarts says."""
    from ddpkit.job import start as job_start

    seen = {}
    monkeypatch.setattr(job_start, "_launch", lambda cfg, *a: seen.setdefault("cfg", cfg) and 0)
    monkeypatch.delenv("RANK", raising=False)
    cfg = TrainConfig(output=str(tmp_path / "run"), nproc=1, batch_size=12, epochs=1)
    job_start.start(cfg, RunConfig("w", nnodes=3, min_nodes=2, max_restarts=0,
                                   rdzv_endpoint="127.0.0.1:29400"))
    assert seen["cfg"].resume == "auto"
