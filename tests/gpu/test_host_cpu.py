"""`bench/host_cpu.py`, the device check's CPU section: it must pin its two threads to two
physical cores (never two hyperthreads of one), read the CPU's extensions, and turn
step_profile's table into rows."""

from __future__ import annotations

import pytest

from bench.host_cpu import cpu_summary, parse_step_profile, two_cores


def _sysfs(tmp_path, topology: dict[int, tuple[int, int]]) -> str:
    for cpu, (package, core) in topology.items():
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(f"{package}\n")
        (d / "core_id").write_text(f"{core}\n")
    return str(tmp_path)


def test_two_cores_skips_hyperthread_siblings_and_cpu0(tmp_path):
    # Linux numbers a core's second hyperthread after all the first ones on many Xeons (0-7
    # then 8-15) and next to it on others (0,1 then 2,3): both layouts must give two cores.
    split = _sysfs(tmp_path / "a", {c: (0, c % 8) for c in range(16)})
    assert two_cores(split, set(range(16))) == [1, 2]
    adjacent = _sysfs(tmp_path / "b", {c: (0, c // 2) for c in range(16)})
    assert two_cores(adjacent, set(range(16))) == [2, 4]
    # only CPU 0's core and one other: CPU 0's sibling is taken rather than failing
    assert two_cores(adjacent, {0, 1, 2}) == [1, 2]
    assert two_cores(adjacent, {0, 2}) == [0, 2]


def test_two_cores_refuses_one_core_and_survives_missing_topology(tmp_path):
    one_core = _sysfs(tmp_path / "a", {0: (0, 0), 1: (0, 0)})
    with pytest.raises(ValueError, match="fewer than two physical cores"):
        two_cores(one_core, {0, 1})
    assert two_cores(str(tmp_path / "none"), {0, 3, 5}) == [3, 5]  # each CPU its own core


def test_cpu_summary_reads_model_and_isa(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\n"
        "flags\t\t: fpu avx2 fma avx512f avx512_bf16 amx_tile amx_bf16 amx_int8\n\n"
        "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n"
    )
    model, isa = cpu_summary(str(info))
    assert model == "Intel(R) Xeon(R) Processor"
    assert isa == ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]


def test_parse_step_profile_table():
    text = (
        "noise before\n"
        "SmolLM2-135M bf16 (random), 2 threads, ...\n"
        "case         served    module       qkv attention\n"
        "decode        52.10     55.00     10.00     20.00\n"
        "prefill      150.00    160.00     40.00     10.00\n"
        "(ms, medians; served: ...)\n"
        "decode 1 2 3 4\n"
    )
    rows = parse_step_profile(text)
    assert rows == [
        dict(case="decode", served="52.10", module="55.00", qkv="10.00", attention="20.00"),
        dict(case="prefill", served="150.00", module="160.00", qkv="40.00", attention="10.00"),
    ]
    assert parse_step_profile("no table") == []
