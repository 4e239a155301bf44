"""benchmarks/goodput_at_scale.py: the simulation keeps its books and drives the policy as the run would."""

from __future__ import annotations

import pytest

from benchmarks.goodput_at_scale import (
    CAUSES,
    Assumptions,
    Fault,
    Ledger,
    draw_faults,
    main,
    simulate,
)

DAY = 86_400.0


def cause(name: str):
    return next(c for c in CAUSES if c.name == name)


def test_a_fault_free_run_loses_only_its_saves():
    led = simulate(1024, "store", [], Assumptions(), days=0.5)
    assert led.wall() == pytest.approx(0.5 * DAY)
    assert led.failures == 0 and led.wasted_progress == 0
    assert 0 < led.checkpoint < 0.01 * DAY
    assert led.productive == pytest.approx(led.wall() - led.checkpoint - led.startup)  # the first start


def test_a_gpu_that_fails_its_health_check_is_replaced_at_once_other_broken_hosts_after_a_doomed_retry():
    """after_attempt leaves a host out at once when its GPU fails the health check after the fault, and else at its
    second failure: the simulation pays for that doomed retry."""
    a = Assumptions()
    gpu = simulate(1024, "store", [Fault(3600.0, cause("faulty GPU"), host=5)], a, days=0.2)
    assert (gpu.failures, gpu.replaced, gpu.queue) == (1, 1, a.replace_s)
    assert gpu.startup == pytest.approx(2 * a.startup_s)  # the first attempt and the one after
    psu = simulate(1024, "store", [Fault(3600.0, cause("power supply"), host=5)], a, days=0.2)
    assert (psu.failures, psu.replaced) == (2, 1)
    assert psu.startup == pytest.approx(3 * a.startup_s)  # the first attempt, the doomed retry, the one after


def test_a_software_bug_keeps_the_host_and_resumes_from_host_memory():
    led = simulate(1024, "memory", [Fault(3600.0, cause("software bug"), host=5)], Assumptions(), days=0.2)
    assert (led.failures, led.replaced) == (1, 0)
    assert dict(led.recoveries) == {"memory": 1}


def test_a_lost_host_resumes_from_the_store_unless_a_peer_holds_its_copy():
    faults = [Fault(3600.0, cause("power supply"), host=5)]
    own = simulate(1024, "memory", faults, Assumptions(), days=0.2)
    peer = simulate(1024, "memory+peer", faults, Assumptions(), days=0.2)
    assert dict(own.recoveries) == {"store": 1}
    assert dict(peer.recoveries) == {"memory": 1}


def test_a_network_hang_waits_the_watchdogs_allowance():
    a = Assumptions(step_s=6.0)
    led = simulate(1024, "store", [Fault(3600.0, cause("network switch or cable"), host=0)], a, days=0.2)
    assert led.detection == pytest.approx(120.0)  # max(hang_floor_s, hang_factor x median step)


def test_every_second_of_the_wall_is_in_one_bucket_and_faults_follow_llama_3s_rate():
    faults = draw_faults(16_384, 2.0, seed=1)
    assert 8 <= len(faults) <= 25  # 419 in 54 days: 15.5 expected in 2
    led = simulate(16_384, "memory", faults, Assumptions(), days=2.0)
    assert led.wall() == pytest.approx(2 * DAY)
    assert all(getattr(led, b) >= 0 for b in Ledger.BUCKETS)
    assert led.failures >= len(faults)


def test_the_benchmark_prints_each_scale_and_variant(capsys):
    lines: list[str] = []
    results = main(["--scales", "1024,16384", "--days", "1", "--seeds", "1"], say=lines.append)
    assert set(results) == {(g, v) for g in (1024, 16384) for v in ("store", "memory", "memory+peer", "store, 2nd")}
    for s in results.values():
        assert 0.5 < s["vs_clean"][0] <= 1.0
    assert results[16384, "store, 2nd"]["failures"][0] > results[16384, "store"]["failures"][0]  # doomed retries
    assert any("memory+peer: the memory tier as built" in line for line in lines)


def test_the_peer_copy_makes_a_snapshot_commit_later_by_the_copy_to_the_peer():
    a = Assumptions()
    assert a.commit_s("memory", peer=True) == pytest.approx(a.commit_s("memory") + a.state_bytes / a.peer_bps)
    assert a.commit_s("store", peer=True) == a.commit_s("store")


def test_scales_that_are_not_whole_hosts_are_one_line():
    with pytest.raises(SystemExit, match="multiples of 8"):
        main(["--scales", "1020"], say=lambda _: None)


def test_an_assumption_is_a_flag():
    lines: list[str] = []
    main(["--scales", "1024", "--days", "0.1", "--seeds", "1", "--store-bps", "1e6"], say=lines.append)
    assert "commit 346.34 s to the store" in lines[0]
