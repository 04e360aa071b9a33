"""Tests for ddpkit.slurm: hostlists, ports, tasks-per-node and sbatch rendering.

Pure functions, so no Slurm installation is needed (only bash for the syntax check).
"""
from __future__ import annotations

import shutil
import subprocess

import pytest

from ddpkit.errors import ConfigError, DDPKitError
from ddpkit.slurm import (
    MAX_HOSTS,
    expand_nodelist,
    first_host,
    parse_tasks_per_node,
    port_from_job_id,
    render_sbatch,
)

EXPANSIONS = [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("node[08-11]", ["node08", "node09", "node10", "node11"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),
    ("node[098-101]", ["node098", "node099", "node100", "node101"]),
    ("gpu-[1-3]", ["gpu-1", "gpu-2", "gpu-3"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("a[1-2],b3,c[05-06]", ["a1", "a2", "b3", "c05", "c06"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("n[3]", ["n3"]),
    ("n[3]x", ["n3x"]),
    ("n[1,3-4]-ib", ["n1-ib", "n3-ib", "n4-ib"]),
    ("login1,login2", ["login1", "login2"]),
    (" a[1-2] , b3 ", ["a1", "a2", "b3"]),
    ("node[01-02],node01", ["node01", "node02", "node01"]),
]

MALFORMED = [
    "",
    "   ",
    "node[01-04",
    "node01-04]",
    "node[[1-2]]",
    "node[5-3]",
    "node[]",
    "node[a-b]",
    "node[1-]",
    "node[-2]",
    "node[1-2-3]",
    "node[1,,2]",
    "a,,b",
    "a,",
    "my node1",
]


@pytest.mark.parametrize("nodelist, expected", EXPANSIONS)
def test_expand_nodelist(nodelist: str, expected: list[str]) -> None:
    assert expand_nodelist(nodelist) == expected


@pytest.mark.parametrize("nodelist, expected", EXPANSIONS)
def test_first_host_matches_expansion(nodelist: str, expected: list[str]) -> None:
    assert first_host(nodelist) == expected[0]


@pytest.mark.parametrize("nodelist", MALFORMED)
@pytest.mark.parametrize("func", [expand_nodelist, first_host])
def test_malformed_nodelist_raises_config_error(func, nodelist: str) -> None:
    with pytest.raises(ConfigError) as info:
        func(nodelist)
    message = str(info.value)
    assert repr(nodelist) in message
    assert "\n" not in message
    assert isinstance(info.value, DDPKitError)


def test_malformed_tail_is_caught_by_first_host() -> None:
    with pytest.raises(ConfigError, match="reversed"):
        first_host("node01,node[5-3]")


def test_huge_nodelist_is_rejected() -> None:
    with pytest.raises(ConfigError, match=str(MAX_HOSTS)):
        expand_nodelist(f"n[1-{MAX_HOSTS + 1}]")
    with pytest.raises(ConfigError, match=str(MAX_HOSTS)):
        expand_nodelist("r[1-1000]-n[1-1000]")
    assert first_host("r[1-1000]-n[1-1000]") == "r1-n1"


@pytest.mark.parametrize("job_id", ["123456", 123456, " 123456 ", "1234_5", "1234_[1-3]", "abc", "0", 0])
def test_port_is_deterministic_and_in_range(job_id) -> None:
    ports = {port_from_job_id(job_id) for _ in range(3)}
    assert len(ports) == 1
    assert 15000 <= ports.pop() < 35000


def test_port_numeric_formula_and_str_int_agree() -> None:
    assert port_from_job_id("123456") == 15000 + 123456 % 20000 == port_from_job_id(123456)
    assert port_from_job_id(7, base=40000, span=100) == 40007
    assert port_from_job_id(107, base=40000, span=100) == 40007


def test_port_array_job_uses_stable_hash() -> None:
    import zlib

    assert port_from_job_id("1234_5") == 15000 + zlib.crc32(b"1234_5") % 20000
    assert port_from_job_id("1234_5") != port_from_job_id("1234_6")


@pytest.mark.parametrize("base, span", [(0, 10), (15000, 0), (60000, 10000), (-5, 10)])
def test_port_bad_range(base: int, span: int) -> None:
    with pytest.raises(ConfigError, match="base"):
        port_from_job_id("1", base=base, span=span)


@pytest.mark.parametrize("job_id", ["", "  ", "-5", -5, None, 1.5, True])
def test_port_bad_job_id(job_id) -> None:
    with pytest.raises(ConfigError, match="job id"):
        port_from_job_id(job_id)


@pytest.mark.parametrize(
    "value, expected",
    [
        ("4", [4]),
        ("2(x3)", [2, 2, 2]),
        ("2(x3),1", [2, 2, 2, 1]),
        ("1,2(x2),3", [1, 2, 2, 3]),
        (" 8(x2) ", [8, 8]),
    ],
)
def test_parse_tasks_per_node(value: str, expected: list[int]) -> None:
    assert parse_tasks_per_node(value) == expected


@pytest.mark.parametrize("value", ["", "x", "2(3)", "2(x)", "2(x3", "0", "2(x0)", "4,", "-1", "2x3"])
def test_parse_tasks_per_node_malformed(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_tasks_per_node(value)
    assert repr(value) in str(info.value)


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
    assert '--rdzv-endpoint "$head_node:29400"' in srun[0]
    assert '--rdzv-id "$SLURM_JOB_ID"' in srun[0]
    assert srun[0].endswith("train.py --name 'my run' --lr=1e-3")
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
    assert '--rdzv-endpoint "$head_node:29500"' in text


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
