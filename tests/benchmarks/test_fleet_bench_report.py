"""fleet_bench without a fleet: its table reports spreads over repeats, user traffic is seeded,
shuffled and bounded, later turns are credited to their home replica by fingerprint, and
scale-out refuses to print a ratio on a machine without the cores."""

from __future__ import annotations

import os

import pytest

from benchmarks import fleet_bench
from benchmarks.fleet_bench import Reply, Result, Users, arrivals, later_turns_home, report


def result(policy: str, cached: int, system: bool = True, per_replica=(16, 16)) -> Result:
    return Result(policy, system, 32, 1000, cached, 240, 10.0, list(per_replica), 1000, cached)


def test_each_figure_is_a_spread_over_its_runs_and_the_ratio_is_of_medians() -> None:
    runs = [
        result("one-replica", 800, per_replica=[32]),
        result("session-hash", 700, per_replica=[12, 20]),
        result("one-replica", 850, per_replica=[32]),
        result("session-hash", 780),
        result("one-replica", 820, per_replica=[32]),
        result("session-hash", 760),
    ]
    rows = report(runs).splitlines()[2:]
    assert len(rows) == 2
    assert rows[0].startswith("| one-replica | shared | 3 | 0.800 / 0.820 / 0.850 | 1.00x |")
    # median 0.760 against one replica's median 0.820
    assert rows[1].startswith("| session-hash | shared | 3 | 0.700 / 0.760 / 0.780 | 0.93x |")
    assert "| 50% / 50% / 62% |" in rows[1]


def test_a_policy_is_compared_only_with_one_replica_on_the_same_prompts() -> None:
    runs = [result("one-replica", 800, system=False, per_replica=[32]), result("round-robin", 600)]
    rows = report(runs).splitlines()[2:]
    assert rows[1].startswith("| round-robin | shared | 1 | 0.600 | - |")


def test_later_turns_count_home_only_on_the_replica_of_the_first_turn() -> None:
    replies = [
        Reply(0, 0, 10, 0, 4, "fp_a"),
        Reply(0, 1, 20, 10, 4, "fp_a"),
        Reply(0, 2, 30, 0, 4, "fp_b"),  # moved
        Reply(1, 0, 10, 0, 4, "fp_b"),
        Reply(1, 1, 20, 10, 4, "fp_b"),
    ]
    assert later_turns_home(replies) == (3, 2)


def test_user_arrivals_are_seeded_shuffled_and_spread_over_the_think_time() -> None:
    users = Users(think_s=4.0, in_flight=2, seed=7)
    plan = arrivals(12, users)
    order = [c for c, _, _ in plan]
    starts = [s for _, s, _ in plan]
    assert sorted(order) == list(range(12)) and order != list(range(12))
    assert starts == sorted(starts) and all(0 <= s < 4.0 for s in starts)
    again = arrivals(12, users)
    assert [(c, s) for c, s, _ in again] == [(c, s) for c, s, _ in plan]
    # a conversation's own draws (think time, reply lengths) do not depend on the others
    assert plan[0][2].random() == again[0][2].random()
    assert [(c, s) for c, s, _ in arrivals(12, Users(4.0, 2, seed=8))] != [
        (c, s) for c, s, _ in plan
    ]


@pytest.mark.parametrize(
    ("cores", "load", "replicas", "refused"),
    [
        (2, 0.0, 2, True),  # the project's 2-core machines: never
        (4, 0.0, 2, False),
        (4, 0.5, 2, True),  # a core is busy elsewhere
        (16, 7.0, 8, True),  # 9 free, 10 needed
        (16, 3.0, 2, False),
    ],
)
def test_scale_out_needs_a_free_core_per_replica_the_router_and_the_client(
    cores: int, load: float, replicas: int, refused: bool
) -> None:
    why = fleet_bench.scale_out_refusal(cores, load, replicas)
    assert (why is not None) == refused
    if refused:
        assert f"needs {replicas + 2} free cores" in why and "no ratio" in why


def test_scale_out_refuses_here_without_starting_anything(capsys: pytest.CaptureFixture) -> None:
    replicas = len(os.sched_getaffinity(0)) + 1  # more than this machine has, whatever it is
    code = fleet_bench.main(["--mode", "scale-out", "--replicas", str(replicas), "--tiny"])
    out = capsys.readouterr().out
    assert code == fleet_bench.REFUSED_EXIT
    assert f"needs {replicas + 2} free cores" in out
    assert "ratio to one replica" not in out


def test_help_says_what_it_needs_how_long_it_runs_and_what_it_serves(
    capsys: pytest.CaptureFixture,
) -> None:
    with pytest.raises(SystemExit):
        fleet_bench.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "scripts/setup_routers.sh" in text and "$RADIXKV_ROUTERS_DIR" in text
    assert "minutes per run" in text and "127.0.0.1 only" in text


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--traffic", "users", "--conversations", "2", "--replicas", "2"], "--conversations"),
        (["--in-flight", "0"], "--in-flight"),
        (["--think-s", "-1"], "--think-s"),
        (["--repeats", "0"], "--repeats"),
    ],
)
def test_bad_settings_are_refused_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit):
        fleet_bench.parse_args(argv)
    assert flag in capsys.readouterr().err
