"""Tests for ddpkit.env.slurm: hostlists, ports and tasks-per-node.

Pure functions, so no Slurm installation is needed.
"""
from __future__ import annotations


import pytest

from ddpkit.base.errors import ConfigError, DDPKitError
from ddpkit.env.slurm import (
    MAX_HOSTS,
    expand_nodelist,
    first_host,
    parse_tasks_per_node,
    port_from_job_id,
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
