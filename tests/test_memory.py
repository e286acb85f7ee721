"""The ledger counts live and peak bytes per tier and tag; byte sizes parse and print."""

from __future__ import annotations

import threading

import pytest

from zeroinf.memory import Ledger, Tier, format_bytes, format_decimal_bytes, parse_bytes, ssd_wear


def test_reserve_release_live_and_peak() -> None:
    ledger = Ledger()
    ledger.reserve(Tier.DEVICE, 100, "param_shard")
    ledger.reserve("device", 50, "grad_shard")  # tiers may be named by value
    ledger.reserve(Tier.HOST, 7, "optim_state")
    assert ledger.live_bytes(Tier.DEVICE) == 150
    assert ledger.live_bytes(Tier.DEVICE, "param_shard") == 100
    assert ledger.live_bytes(Tier.DEVICE, "never_used") == 0
    assert ledger.live_bytes(Tier.HOST) == 7 and ledger.live_bytes(Tier.NVME) == 0
    ledger.release(Tier.DEVICE, 100, "param_shard")
    assert ledger.live_bytes(Tier.DEVICE) == 50
    assert ledger.peak_bytes(Tier.DEVICE) == 150
    ledger.reserve(Tier.DEVICE, 60, "param_shard")
    assert ledger.peak_bytes(Tier.DEVICE) == 150  # 110 live: below the old peak
    ledger.reserve(Tier.DEVICE, 60, "param_shard")
    assert ledger.peak_bytes(Tier.DEVICE) == 170


def test_reset_peak_starts_from_live() -> None:
    ledger = Ledger()
    ledger.reserve(Tier.HOST, 1000, "a")
    ledger.release(Tier.HOST, 600, "a")
    assert ledger.peak_bytes(Tier.HOST) == 1000
    ledger.reset_peak()
    assert ledger.peak_bytes(Tier.HOST) == 400 and ledger.peak_bytes(Tier.DEVICE) == 0
    ledger.reserve(Tier.HOST, 10, "b")
    assert ledger.peak_bytes(Tier.HOST) == 410


def test_snapshot_is_plain_data_without_empty_tags() -> None:
    ledger = Ledger()
    ledger.reserve(Tier.DEVICE, 64, "param_shard")
    ledger.reserve(Tier.DEVICE, 32, "grad_shard")
    ledger.release(Tier.DEVICE, 32, "grad_shard")
    snap = ledger.snapshot()
    assert snap == {
        "device": {"live_bytes": 64, "peak_bytes": 96, "by_tag": {"param_shard": 64}},
        "host": {"live_bytes": 0, "peak_bytes": 0, "by_tag": {}},
        "nvme": {"live_bytes": 0, "peak_bytes": 0, "by_tag": {}},
    }
    ledger.reserve(Tier.DEVICE, 1, "param_shard")
    assert snap["device"]["live_bytes"] == 64  # a copy, not a live view


def test_double_release_raises() -> None:
    ledger = Ledger()
    ledger.reserve(Tier.DEVICE, 128, "flat")
    ledger.release(Tier.DEVICE, 128, "flat")
    with pytest.raises(RuntimeError, match="double free"):
        ledger.release(Tier.DEVICE, 128, "flat")
    with pytest.raises(RuntimeError, match="'other'"):
        ledger.release(Tier.DEVICE, 1, "other")
    assert ledger.live_bytes(Tier.DEVICE) == 0


def test_release_more_than_the_tag_holds_raises() -> None:
    ledger = Ledger()
    ledger.reserve(Tier.HOST, 10, "a")
    ledger.reserve(Tier.HOST, 10, "b")
    with pytest.raises(RuntimeError, match="only 10 are reserved"):
        ledger.release(Tier.HOST, 15, "a")  # the tier holds 20, but not under this tag
    ledger.release(Tier.HOST, 10, "a")
    with pytest.raises(RuntimeError):
        ledger.release(Tier.NVME, 10, "b")  # the right tag on the wrong tier


def test_negative_reserve_raises() -> None:
    ledger = Ledger()
    with pytest.raises(ValueError, match="negative"):
        ledger.reserve(Tier.DEVICE, -1, "x")
    assert ledger.live_bytes(Tier.DEVICE) == 0


def test_negative_release_raises() -> None:
    ledger = Ledger()
    ledger.reserve(Tier.DEVICE, 8, "x")
    with pytest.raises(ValueError, match="negative"):
        ledger.release(Tier.DEVICE, -8, "x")


def test_unknown_tier_raises() -> None:
    with pytest.raises(ValueError, match="gpu"):
        Ledger().reserve("gpu", 1, "x")


def test_concurrent_reserve_release_balances() -> None:
    ledger = Ledger()

    def work() -> None:
        for _ in range(500):
            ledger.reserve(Tier.HOST, 3, "io")
            ledger.release(Tier.HOST, 3, "io")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ledger.live_bytes(Tier.HOST) == 0 and 3 <= ledger.peak_bytes(Tier.HOST) <= 12


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("1048576", 1048576),
        ("0", 0),
        ("4GiB", 4 * 2**30),
        ("512MB", 512 * 10**6),
        ("512 MiB", 512 * 2**20),
        ("1.5KiB", 1536),
        ("2k", 2000),
        ("3 tb", 3 * 10**12),
        ("1TiB", 2**40),
        ("10b", 10),
        ("  8 gib ", 8 * 2**30),
        ("1_000_000", 10**6),
    ],
)
def test_parse_bytes(text: str, nbytes: int) -> None:
    assert parse_bytes(text) == nbytes


@pytest.mark.parametrize("text", ["", "GiB", "four GiB", "4 XB", "4GiBs", "1.2.3MB"])
def test_parse_bytes_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_parse_bytes_message_names_input_and_fix() -> None:
    with pytest.raises(ValueError, match=r"'4 XB'.*use e\.g\. 4GiB"):
        parse_bytes("4 XB")


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (3 * 2**20, "3.0 MiB"),
        (5 * 2**30 // 2, "2.5 GiB"),
        (2**40, "1.0 TiB"),
        (2**50, "1024.0 TiB"),
        (-2048, "-2.0 KiB"),
    ],
)
def test_format_bytes(nbytes: int, text: str) -> None:
    assert format_bytes(nbytes) == text


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [(512, "512 B"), (1500, "1.50 kB"), (4.2e6, "4.20 MB"), (27.5e9, "27.50 GB"), (275e12, "275.00 TB")],
)
def test_format_decimal_bytes(nbytes: float, text: str) -> None:
    assert format_decimal_bytes(nbytes) == text


def test_ssd_wear_states_a_step_and_ten_thousand() -> None:
    assert ssd_wear(27.5e9).startswith("27.50 GB written a step, 275.00 TB per 10,000 steps (SSD wear")


@pytest.mark.parametrize("nbytes", [1, 1536, 3 * 2**20, 7 * 2**30])
def test_format_then_parse_round_trips_binary_sizes(nbytes: int) -> None:
    assert parse_bytes(format_bytes(nbytes).replace(" ", "")) == nbytes
