"""Tests for ddpkit.launchers.sbatch: the sbatch script `ddpkit slurm` prints.

Pure text, so no Slurm installation is needed (only bash for the syntax check).
"""
from __future__ import annotations

import shutil
import signal
import subprocess
import time

import pytest

from ddpkit.base.errors import ConfigError
from ddpkit.launchers.sbatch import render_sbatch


def test_render_sbatch_gpu_contents() -> None:
    text = render_sbatch(
        2, 4, "train.py", ["--name", "my run", "--lr=1e-3"],
        job_name="exp1", time="02:00:00", partition="gpu", cpus_per_task=32, port=29400,
        extra_sbatch=["--mem=64G", "#SBATCH --exclusive"],
    )
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for directive in [
        "--nodes=2", "--ntasks-per-node=1", "--gres=gpu:4", "--cpus-per-task=32",
        "--time=02:00:00", "--job-name=exp1", "--partition=gpu", "--mem=64G", "--exclusive",
    ]:
        assert f"#SBATCH {directive}" in lines
    assert "set -euo pipefail" in lines
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text
    srun = [line for line in lines if line.startswith("srun ")]
    assert len(srun) == 1
    assert "ddpkit run" in srun[0]
    assert '--nnodes "$SLURM_NNODES"' in srun[0]
    assert "--nproc 4 " in srun[0]
    assert '--rdzv-endpoint "$head_node:$port"' in srun[0] and "port=29400" in lines
    assert '--rdzv-id "$SLURM_JOB_ID"' in srun[0]
    # In the background (" &"): the batch shell must be free to take Slurm's SIGUSR1.
    assert srun[0].endswith("train.py --name 'my run' --lr=1e-3 &")
    # All directives precede the first command, or sbatch ignores them.
    last_directive = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    assert last_directive < lines.index("set -euo pipefail")


def test_render_sbatch_cpu_nodes_omit_gres() -> None:
    text = render_sbatch(3, 0, "train.py")
    assert "--gres" not in text
    assert "#SBATCH --nodes=3" in text
    assert "--nproc 1 " in text
    assert "--partition" not in text
    assert "--cpus-per-task" not in text
    # One port per job (from its id), the formula the library uses under srun.
    assert "port=$((15000 + SLURM_JOB_ID % 20000))" in text.splitlines()


def test_render_sbatch_quotes_hostile_script_path() -> None:
    text = render_sbatch(1, 1, "my dir/train $HOME.py", ["a;b", "`x`"])
    assert "'my dir/train $HOME.py' 'a;b' '`x`'" in text


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(nodes=2, gpus_per_node=4, script="train.py", script_args=["--name", "my run", "it's"]),
        dict(nodes=1, gpus_per_node=0, script="dir with space/t.py", partition="cpu", cpus_per_task=8),
    ],
)
def test_render_sbatch_passes_bash_n(kwargs) -> None:
    text = render_sbatch(**kwargs)
    result = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(nodes=0), "nodes"),
        (dict(nodes=True), "nodes"),
        (dict(gpus_per_node=-1), "gpus_per_node"),
        (dict(port=0), "port"),
        (dict(port=65536), "port"),
        (dict(script=""), "script"),
        (dict(script="   "), "script"),
        (dict(cpus_per_task=0), "cpus_per_task"),
        (dict(script_args="--epochs 3"), "script_args"),
        (dict(job_name="my job"), "job_name"),
        (dict(time=""), "time"),
        (dict(partition="gpu\n#SBATCH --x"), "partition"),
        (dict(extra_sbatch=["--mem=1G\nrm -rf /"]), "extra_sbatch"),
    ],
)
def test_render_sbatch_validation(kwargs, word: str) -> None:
    args = dict(nodes=2, gpus_per_node=4, script="train.py")
    args.update(kwargs)
    with pytest.raises(ConfigError, match=word) as info:
        render_sbatch(**args)
    assert "\n" not in str(info.value)


def test_render_sbatch_passes_the_rendezvous_timeout_and_restarts_to_every_node() -> None:
    text = render_sbatch(2, 4, "train.py", ["--epochs", "90"], rdzv_timeout=300, max_restarts=1,
                         requeue_grace=None)
    assert text.splitlines()[-1].endswith(
        '--rdzv-id "$SLURM_JOB_ID" --rdzv-timeout 300 --max-restarts 1 train.py --epochs 90')
    assert "--rdzv-timeout" not in render_sbatch(2, 4, "train.py")
    for bad in ({"rdzv_timeout": 0}, {"rdzv_timeout": "5"}, {"max_restarts": -1}):
        with pytest.raises(ConfigError):
            render_sbatch(2, 4, "train.py", **bad)


def test_render_sbatch_asks_for_a_signal_before_the_end_and_requeues_after_the_checkpoint():
    text = render_sbatch(2, 4, "train.py", requeue_grace=90)
    assert "#SBATCH --signal=B:USR1@90" in text and "#SBATCH --requeue" in text
    assert "#SBATCH --open-mode=append" in text  # the preempted run's log stays
    lines = text.splitlines()
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert lines[srun].endswith(" &") and lines[srun + 1] == "step=$!"
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text and lines[-1] == 'exit "$rc"'
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=60" in lines  # the agent waits for the save
    assert "--signal" not in render_sbatch(2, 4, "train.py", requeue_grace=None)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("signal_it,step_status,status,log", [
    (True, 138, 0, ["step started", "step got USR1", "scontrol requeue 42"]),
    (False, 3, 3, ["step started"]),           # a failure is not requeued: its status stays
    (True, 1, 1, ["step started", "step got USR1"]),  # no checkpoint-stop (138): no requeue
])
def test_the_rendered_requeue_forwards_sigusr1_and_requeues_only_a_checkpointed_stop(
        tmp_path, signal_it, step_status, status, log):
    # The batch script with srun and scontrol stubbed: SIGUSR1 to the batch shell reaches the
    # step; the job is requeued only when the step stopped with 138 (128 + SIGUSR1).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        "#!/bin/bash\ntrap 'echo step got USR1 >> \"$LOG\"; exit $STATUS' USR1\n"
        "echo step started >> \"$LOG\"\n"
        "if [ \"$SIGNALLED\" = 0 ]; then exit $STATUS; fi\nwhile true; do sleep 0.05; done\n")
    (bin_dir / "scontrol").write_text("#!/bin/bash\nif [ \"$1\" = show ]; then echo node1; "
                                      "else echo \"scontrol $*\" >> \"$LOG\"; fi\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text(render_sbatch(1, 0, "train.py"))
    logfile = tmp_path / "log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "LOG": str(logfile), "SLURM_JOB_ID": "42",
           "SLURM_JOB_NODELIST": "node1", "SLURM_NNODES": "1", "STATUS": str(step_status),
           "SIGNALLED": str(int(signal_it))}
    proc = subprocess.Popen(["bash", str(script)], env=env)
    if signal_it:
        deadline = time.monotonic() + 10
        while not (logfile.exists() and "step started" in logfile.read_text()):
            assert time.monotonic() < deadline, "the step never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=10) == status
    assert logfile.read_text().splitlines() == log


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
@pytest.mark.parametrize("job_id", ["1", "123456", "4294967"])
def test_the_rendered_port_is_the_one_the_library_derives_from_the_job_id(job_id) -> None:
    from ddpkit.launchers.sbatch import PORT_FROM_JOB_ID
    from ddpkit.env.slurm import port_from_job_id

    res = subprocess.run(["bash", "-c", f"echo {PORT_FROM_JOB_ID}"], capture_output=True,
                         text=True, env={"SLURM_JOB_ID": job_id}, timeout=30)
    assert int(res.stdout) == port_from_job_id(job_id)


def test_an_elastic_script_keeps_the_job_and_step_when_a_node_fails():
    text = render_sbatch(3, 0, "train.py", ["--epochs", "2"], min_nodes=2, requeue_grace=None)
    assert "#SBATCH --no-kill" in text
    assert ('srun --no-kill --kill-on-bad-exit=0 ddpkit run --nnodes 2:"$SLURM_NNODES" --nproc 1 '
            '--rdzv-endpoint "$head_node:$port"') in text
    assert "--no-kill" not in render_sbatch(3, 0, "train.py", requeue_grace=None)


@pytest.mark.parametrize("min_nodes, message", [(3, "--min-nodes 3 must be smaller than --nodes 3"),
                                                (0, "min_nodes")])
def test_an_elastic_script_needs_fewer_min_nodes_than_nodes(min_nodes, message):
    with pytest.raises(ConfigError, match=message):
        render_sbatch(3, 0, "train.py", min_nodes=min_nodes)


@pytest.mark.parametrize("time_limit", ["soon", "1h", "01:00:00:00", "-5", "1-", "2-1:2:3:4",
                                        "10:", ":30", "1.5"])
def test_a_time_limit_slurm_would_refuse_is_one_line_naming_its_formats(time_limit):
    with pytest.raises(ConfigError) as info:
        render_sbatch(2, 4, "train.py", time=time_limit)
    message = str(info.value)
    assert "\n" not in message and f"--time {time_limit!r}" in message
    for form in ('"minutes"', '"minutes:seconds"', '"hours:minutes:seconds"', '"days-hours"',
                 '"days-hours:minutes"', '"days-hours:minutes:seconds"'):
        assert form in message


@pytest.mark.parametrize("time_limit", ["90", "30:00", "01:30:00", "2-00", "2-12:30",
                                        "1-00:00:00", "UNLIMITED", "infinite"])
def test_every_time_format_slurm_takes_is_rendered_as_given(time_limit):
    assert f"#SBATCH --time={time_limit}\n" in render_sbatch(2, 4, "train.py", time=time_limit)
