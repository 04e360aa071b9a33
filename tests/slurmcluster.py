"""A private, real Slurm cluster for tests: one ``slurmctld`` and N ``slurmd``, each node in its own
network namespace (:mod:`netns`), authenticated by a private ``munged``.

    with SlurmCluster(2, workdir=tmp_path) as slurm:
        job = slurm.sbatch(script_path)
        assert slurm.wait(job, timeout=120).state == "COMPLETED"

Nodes are ``node1`` .. ``nodeN`` at ``10.213.0.1`` .. (the namespaces' own /etc/hosts name them, as
DNS does on a real cluster); ``slurmctld`` runs beside ``slurmd`` on ``node1``. Daemons use Debian's
``slurm-wlm`` and ``munge`` (``scripts/install_slurm.sh``), run in the foreground as children of
the test, and are killed by PID on exit, also on failure, timeout or KeyboardInterrupt. No cgroup
plug-in is configured (``proctrack/linuxproc``, ``task/none``): the namespaces' remounted /sys does
not matter, and nothing on the host is touched. Client commands (``sbatch``, ``scontrol``, ...) run
inside ``node1``'s namespace with ``SLURM_CONF`` pointing at the private configuration.
"""
from __future__ import annotations

import atexit
import functools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import netns

__all__ = ["SlurmCluster", "JobInfo", "available", "DAEMONS", "CLIENTS"]

DAEMONS = ("slurmctld", "slurmd", "munged", "mungekey", "nsenter")
CLIENTS = ("sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
#: Seconds a requeued job waits before it may start again (Slurm's default is 120).
CRED_EXPIRE = 5


@functools.lru_cache(maxsize=None)
def available() -> Tuple[bool, str]:
    """``(True, "")`` when a private Slurm cluster can run here, else ``(False, why)``.

    Example::

        ok, why = available()
        pytestmark = pytest.mark.skipif(not ok, reason=why)
    """
    ok, why = netns.available()
    missing = [tool for tool in DAEMONS + CLIENTS if shutil.which(tool) is None]
    if ok and missing:
        return False, (f"Slurm is not installed ({', '.join(missing)} missing): "
                       "`sudo bash scripts/install_slurm.sh` (Debian's slurm-wlm and munge)")
    return ok, why


@dataclass
class JobInfo:
    """What ``scontrol show job`` says of a job: its state, exit code, restarts and nodes."""

    job_id: str
    state: str
    exit_code: str
    restarts: int
    nodes: str
    fields: Dict[str, str]


class _Nodes(netns.Cluster):
    """Namespaces named as a Slurm cluster's hosts: ``node1`` .. ``nodeN``; ``scratch`` is a
    directory that each node sees as its own (a node-local disk at one path)."""

    def __init__(self, nodes: int, workdir: Path, scratch: Path, resolvable: bool) -> None:
        super().__init__(nodes, workdir=workdir, hostnames=True)
        self.scratch, self.resolvable = scratch, resolvable

    def hostname(self, node: int) -> str:
        return f"node{node + 1}"

    def _write_hosts(self, ns: str) -> None:
        super()._write_hosts(ns)
        hosts = netns.NETNS_ETC / ns / "hosts"
        if not self.resolvable:  # Slurm still reaches its nodes by NodeAddr
            hosts.write_text("127.0.0.1 localhost\n")
            return
        # The store sees its clients at IPv4-mapped IPv6 addresses: names for those too, as
        # DNS would give (no "hostname of the client socket cannot be retrieved" noise).
        with hosts.open("a") as f:
            f.writelines(f"::ffff:{self.ip(i)} {self.hostname(i)}\n" for i in range(self.nodes))

    def command(self, node: int, argv: Sequence[str]) -> List[str]:
        # Not `ip netns exec`: it remounts /sys, where slurmd's cgroup code looks (even with no
        # cgroup plug-in). nsenter joins the network only; a private mount + UTS namespace then
        # gives the node its own /etc/hosts, /etc/resolv.conf and hostname.
        etc = netns.NETNS_ETC / self.ns(node)
        local = self.workdir / "local" / self.hostname(node)
        local.mkdir(parents=True, exist_ok=True)
        script = ('mount --bind "$1" /etc/hosts && mount --bind "$2" /etc/resolv.conf && '
                  'mount --bind "$3" "$4" && hostname "$0" && shift 4 && exec "$@"')
        return ["nsenter", f"--net=/var/run/netns/{self.ns(node)}", "unshare", "--mount",
                "--uts", "sh", "-c", script, self.hostname(node), str(etc / "hosts"),
                str(etc / "resolv.conf"), str(local), str(self.scratch), *argv]


class SlurmCluster:
    """``nodes`` Slurm compute nodes in network namespaces, a controller on the first one.

    ``workdir`` holds the configuration, state, spools and logs (kept after the test, for its
    report); jobs see it at the same path on every node, as a shared file system, except
    ``scratch`` (node-local). ``resolvable=False``: the nodes' names resolve nowhere (Slurm
    reaches them by address), as where Slurm's node names are not host names.

    Example::

        with SlurmCluster(2, workdir=tmp_path) as slurm:
            print(slurm.run("sinfo").stdout)
    """

    def __init__(self, nodes: int = 2, workdir: Optional[os.PathLike] = None,
                 cpus: int = 16, resolvable: bool = True, slurmd_timeout: int = 60) -> None:
        self.nodes, self.cpus = nodes, cpus
        #: Seconds before slurmctld declares a silent node DOWN (a lost node's step ends then).
        self.slurmd_timeout = slurmd_timeout
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="ddpk-slurm-")).resolve()
        #: A path every node has, each with its own contents (like /tmp or a scratch disk).
        self.scratch = self.workdir / "scratch"
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.net = _Nodes(nodes, self.workdir / "net", self.scratch, resolvable)
        self.daemons: Dict[str, subprocess.Popen] = {}
        self.conf = self.workdir / "slurm.conf"
        # A socket path must fit in 107 bytes: a deep work directory gets a short one in /tmp.
        self.socket = self.workdir / "munge" / "munge.socket"
        self._short = None
        if len(str(self.socket)) > 100:
            self._short = Path(tempfile.mkdtemp(prefix="ddpk-munge-"))
            self.socket = self._short / "munge.socket"

    # ------------------------------------------------------------------ names
    def name(self, node: int) -> str:
        """Slurm's name of ``node`` (0-based): ``node1`` for 0."""
        return self.net.hostname(node)

    @property
    def env(self) -> Dict[str, str]:
        """What a client command needs: the private configuration."""
        return {"SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> "SlurmCluster":
        ok, why = available()
        if not ok:
            raise RuntimeError(why)
        atexit.register(self.close)  # munged runs on the host: never leave it behind
        try:
            self.net.__enter__()
            self._start_munge()
            self._write_conf()
            self._daemon("slurmctld", 0, ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            for i in range(self.nodes):
                self._daemon(f"slurmd-{i}", i, ["slurmd", "-D", "-N", self.name(i),
                                                "-f", str(self.conf)])
            self._wait_idle(timeout=60)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_munge(self) -> None:
        keydir, rundir = self.workdir / "munge" / "key", self.socket.parent
        keydir.mkdir(parents=True, exist_ok=True)
        rundir.mkdir(parents=True, exist_ok=True)
        os.chmod(keydir, 0o700)        # munged refuses a key others could read
        os.chmod(rundir, 0o755)        # and a socket directory clients cannot enter
        key = keydir / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True,
                       capture_output=True, timeout=30)
        self._spawn("munged", ["munged", "-F", "--force", f"--socket={self.socket}",
                               f"--key-file={key}", f"--pid-file={rundir / 'munged.pid'}",
                               f"--seed-file={rundir / 'munged.seed'}",
                               f"--log-file={self.workdir / 'munged.log'}"], None)
        deadline = time.monotonic() + 20
        while not self.socket.exists():
            if self.daemons["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start:\n{self._log('munged')}")
            time.sleep(0.05)

    def _write_conf(self) -> None:
        w = self.workdir
        for sub in ["state"] + [f"spool/{self.name(i)}" for i in range(self.nodes)]:
            (w / sub).mkdir(parents=True, exist_ok=True)
        nodes = [f"NodeName={self.name(i)} NodeAddr={self.net.ip(i)} CPUs={self.cpus} "
                 "State=UNKNOWN" for i in range(self.nodes)]
        lines = [
            "ClusterName=ddpk",
            f"SlurmctldHost={self.name(0)}({self.net.ip(0)})",
            "SlurmctldPort=6817", "SlurmdPort=6818",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.socket},cred_expire={CRED_EXPIRE}",
            f"StateSaveLocation={w / 'state'}", f"SlurmdSpoolDir={w / 'spool'}/%n",
            f"SlurmctldPidFile={w / 'slurmctld.pid'}", f"SlurmdPidFile={w / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={w / 'slurmctld.log'}", f"SlurmdLogFile={w / 'slurmd-%n.log'}",
            "SlurmctldDebug=info", "SlurmdDebug=info",
            # No cgroup plug-in: nothing to mount, and `ip netns exec`'s /sys does not matter.
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "MpiDefault=none", "SwitchType=switch/none",
            "SchedulerType=sched/builtin", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerParameters=sched_interval=1,batch_sched_delay=0",
            # `cpus` per node whatever the machine has: small jobs run side by side.
            "SlurmdParameters=config_overrides",
            "ReturnToService=2", "MinJobAge=3600", "KillWait=10", "InactiveLimit=0",
            f"SlurmdTimeout={self.slurmd_timeout}", "SlurmctldTimeout=60", "MessageTimeout=20",
            *nodes,
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, argv: Sequence[str], node: Optional[int]) -> None:
        cmd = list(argv) if node is None else self.net.command(node, argv)
        out = open(self.workdir / f"{name}.stdout", "ab")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "TORCHELASTIC_", "PET_")) and k not in netns.LAUNCH_VARS}
        env["SLURM_CONF"] = str(self.conf)
        with out:
            self.daemons[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL, env=env,
                                                  start_new_session=True)

    def _daemon(self, name: str, node: int, argv: Sequence[str]) -> None:
        self._spawn(name, argv, node)

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            for name, proc in self.daemons.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}\n{self.logs()}")
            res = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
            states = res.stdout.strip()
            rows = [line.split() for line in states.splitlines()]
            if len(rows) == self.nodes and all(r[1] == "idle" for r in rows):
                return
            time.sleep(0.2)
        raise RuntimeError(f"Slurm nodes not idle after {timeout:.0f} s: {states!r}\n{self.logs()}")

    def close(self) -> None:
        """Kill every daemon (and whatever jobs they left) by PID; remove the namespaces."""
        for proc in reversed(list(self.daemons.values())):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        self.net.close()  # kills every process left in the nodes (slurmstepd, job steps)
        atexit.unregister(self.close)
        if self._short is not None:
            shutil.rmtree(self._short, ignore_errors=True)
        for proc in self.daemons.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ------------------------------------------------------------------ clients
    def command(self, argv: Sequence[str], node: int = 0) -> List[str]:
        """``argv`` run on ``node``'s network (a client: it only talks to slurmctld)."""
        return ["nsenter", f"--net=/var/run/netns/{self.net.ns(node)}", *argv]

    def run(self, *argv: str, check: bool = True, timeout: float = 30,
            node: int = 0) -> subprocess.CompletedProcess:
        """Run a Slurm client command on ``node``, e.g. ``run("scontrol", "requeue", job)``."""
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, **self.env}
        try:
            res = subprocess.run(self.command(argv, node), capture_output=True, text=True,
                                 env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{' '.join(argv)} did not answer within {timeout:.0f} s") from None
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited with {res.returncode}: "
                               f"{res.stderr.strip() or res.stdout.strip()}")
        return res

    def sbatch(self, script: os.PathLike, *options: str, cwd: Optional[os.PathLike] = None,
               env: Optional[Dict[str, str]] = None) -> str:
        """Submit ``script`` (``sbatch --parsable``) from ``cwd``; return the job id.

        ``env`` is the submitting shell's environment (sbatch passes it to the job), on top of
        this process's, less launcher variables.
        """
        clean = {k: v for k, v in os.environ.items()
                 if k not in netns.LAUNCH_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
        clean.update({**self.env, "PYTHONUNBUFFERED": "1", **(env or {})})
        res = subprocess.run(self.command(["sbatch", "--parsable", *options, str(script)]),
                             capture_output=True, text=True, env=clean, timeout=30,
                             cwd=cwd or self.workdir)
        if res.returncode != 0:
            raise RuntimeError(f"sbatch {script} failed ({res.returncode}): {res.stderr.strip()}")
        return res.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> JobInfo:
        """The job's current record (``scontrol show job -o``)."""
        text = self.run("scontrol", "show", "job", "-o", job_id).stdout.strip()
        fields = dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", text))
        return JobInfo(job_id, fields.get("JobState", "?"), fields.get("ExitCode", "?"),
                       int(fields.get("Restarts", "0") or 0), fields.get("NodeList", ""), fields)

    def wait(self, job_id: str, timeout: float,
             states: Sequence[str] = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                      "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
                                      "PREEMPTED")) -> JobInfo:
        """Poll the job until its state is one of ``states``; past ``timeout`` s cancel it and
        raise :class:`TimeoutError` with the logs."""
        info = self.wait_for(job_id, lambda i: i.state in states, timeout,
                             f"ended ({'/'.join(states[:3])}...)", cancel=True)
        return info

    def wait_for(self, job_id: str, predicate, timeout: float, what: str,
                 cancel: bool = False, every: float = 0.5) -> JobInfo:
        """Poll the job every ``every`` s until ``predicate(info)`` holds (e.g. it restarted and
        runs again); a query that fails is retried until the deadline (slurmctld may be busy).
        Past ``timeout``: :class:`TimeoutError` with the logs (``cancel``: the job cancelled)."""
        deadline = time.monotonic() + timeout
        info, failure = None, None
        while True:
            try:
                info, failure = self.job(job_id), None
            except RuntimeError as exc:
                failure = exc
            if info is not None and failure is None and predicate(info):
                return info
            if time.monotonic() > deadline:
                if cancel:
                    self.run("scancel", job_id, check=False)
                seen = (f"{info.state}, {info.restarts} restarts" if info is not None
                        else "never seen")
                raise TimeoutError(f"job {job_id}: not {what} after {timeout:.0f} s ({seen}; "
                                   f"last query: {failure or 'ok'})\n{self.logs()}")
            time.sleep(every)

    # ------------------------------------------------------------------ reports
    def _log(self, name: str) -> str:
        out = []
        for path in sorted(self.workdir.glob(f"{name}*.log")) + sorted(
                self.workdir.glob(f"{name}*.stdout")):
            lines = path.read_text(errors="replace").splitlines()[-20:]
            out.append(f"--- {path.name}:\n" + "\n".join(lines))
        return "\n".join(out)

    def logs(self) -> str:
        """The last lines of every daemon's log, for assertion messages."""
        return "\n".join(self._log(n) for n in ("munged", "slurmctld", "slurmd"))
