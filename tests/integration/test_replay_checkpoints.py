"""Rebuilds from checkpoints: checkpoint plus tail is the whole log's ledger, byte for byte."""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ledgerkit import captured_events, publish_all, run_ledger_until

from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import KafkaConfig
from pipeline.replay.checkpoint import newest
from pipeline.replay.continued import cluster_of, identity_of, rebuild_continued
from pipeline.replay.rebuild import compare, rebuild
from pipeline.replay.store import LedgerStore
from stages.ledger.stage import LedgerConfig
from topics.records import Record

pytestmark = pytest.mark.broker

LEDGER = LedgerConfig(seal_grace_s=30)


def halves(rollouts: list[list[Record]]) -> tuple[list[Record], list[Record]]:
    """The first half of the rollouts whole, and the first half of each of the next ten's
    events: those ten are open at the cut, and their other events are the tail's."""
    whole, split, rest = rollouts[:20], rollouts[20:30], rollouts[30:]
    first = [e for r in whole for e in r] + [e for r in split for e in r[: len(r) // 2]]
    second = [e for r in split for e in r[len(r) // 2 :]] + [e for r in rest for e in r]
    return first, second


def test_checkpoint_plus_tail_is_the_whole_log(kafka_config: KafkaConfig, tmp_path: Path) -> None:
    checkpoints, out = tmp_path / "checkpoints", tmp_path / "ledger.sqlite"

    async def continued(
        directory: Path = checkpoints, store: Path = out, ledger: LedgerConfig = LEDGER
    ) -> Any:
        return await rebuild_continued(kafka_config, store, directory, ledger=ledger, margin_s=0)

    async def go() -> None:
        await ensure_topics(kafka_config)
        first, second = halves(await captured_events(40, seed=3))
        everything = len(first) + len(second)
        await publish_all(kafka_config, first)
        one = await continued()
        assert (one.resumed_from, one.events_before, one.result.events) == (None, 0, len(first))
        assert one.checkpoint is not None
        cluster = await cluster_of(kafka_config)
        with LedgerStore(out) as store:
            cut = newest(checkpoints, identity_of(kafka_config, LEDGER, cluster, store), store.rows()).loaded
        assert cut is not None and cut.cut.events_covered == len(first)
        assert {item.event.key for item in cut.cut.events} == {f"r3-{r}" for r in range(20, 30)}
        (checkpoints / "ledger-00000099.partial").write_bytes(b"left by a writer killed mid-way")

        await publish_all(kafka_config, second)
        two = await continued()
        assert two.resumed_from == one.checkpoint and two.events_before == len(first)
        assert two.result.events == len(second)  # the tail alone was read
        assert not (checkpoints / "ledger-00000099.partial").exists()

        with LedgerStore(tmp_path / "whole.sqlite") as whole:
            result = await rebuild(kafka_config, whole, ledger=LEDGER)
            assert result.events == everything and whole.counts()["receipt"] == 40

            def same_as_whole() -> list[str]:
                with LedgerStore(out) as rebuilt:
                    return compare(rebuilt, whole)

            assert same_as_whole() == []

            # The newest checkpoint corrupt: reported, and the one before it used.
            assert two.checkpoint is not None
            newest_file = checkpoints / two.checkpoint
            data = bytearray(newest_file.read_bytes())
            data[len(data) // 2] ^= 0xFF
            newest_file.write_bytes(bytes(data))
            three = await continued()
            assert three.resumed_from == one.checkpoint and three.result.events == len(second)
            assert three.skipped == [
                f"checkpoint {two.checkpoint}: corrupt: its bytes do not match the SHA-256 in its name"
            ]
            assert same_as_whole() == []

            # Checkpoints cut from another store are refused naming it; that store starts at offset 0.
            elsewhere = tmp_path / "elsewhere"
            shutil.copytree(checkpoints, elsewhere)
            other = await continued(elsewhere, tmp_path / "other.sqlite")
            assert other.resumed_from is None and other.result.events == everything
            refused = [line for line in other.skipped if "another log or ledger: store '" in line]
            assert refused and all(line in refused or "corrupt" in line for line in other.skipped)

            # A store that lost rows it held at the cut is not the one cut: rebuilt whole.
            with sqlite3.connect(out) as db:
                db.execute("DELETE FROM ledger WHERE rowid > 10")
            lost = await continued()
            assert lost.resumed_from is None and lost.result.events == everything
            assert "the ledger holds 10 rows, fewer than the" in lost.skipped[0]
            assert lost.skipped[-1].startswith(
                "ledger ledger.sqlite: holds rows no usable checkpoint was cut from"
            )
            assert same_as_whole() == []

        # Other ledger settings decide otherwise: refused naming them.
        regraced = await continued(ledger=LedgerConfig(seal_grace_s=5))
        assert regraced.resumed_from is None and regraced.result.events == everything
        assert any("ledger 'seal_grace_s=30.0" in line for line in regraced.skipped), regraced.skipped

    asyncio.run(go())


def replay(config: KafkaConfig, *flags: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pipeline.cli", "replay", "--bootstrap", config.bootstrap]
    command += ["--topic-prefix", config.names.prefix, "--partitions", str(config.names.partitions)]
    return subprocess.run(
        [*command, "--seal-grace", "30", *flags], capture_output=True, text=True, timeout=120
    )


def test_replay_check_from_a_checkpoint_equals_the_live_ledger(
    kafka_config: KafkaConfig, tmp_path: Path
) -> None:
    """``tokentrail replay --checkpoints DIR --check``: the second rebuild reads only the
    tail after the first one's checkpoint, and equals the live ledger."""
    checkpoints = ["--checkpoints", str(tmp_path / "ckpt"), "--checkpoint-margin", "0", "--json"]

    async def publish(events: list[Record]) -> None:
        await ensure_topics(kafka_config)
        await publish_all(kafka_config, events)

    first, second = halves(asyncio.run(captured_events(40, seed=5)))
    asyncio.run(publish(first))
    one = replay(kafka_config, "--out", str(tmp_path / "a.sqlite"), *checkpoints)
    assert one.returncode == 0, one.stderr
    report = json.loads(one.stdout)
    assert report["resumed_from"] is None and report["events"] == len(first) and report["checkpoint"]

    asyncio.run(publish(second))
    asyncio.run(run_ledger_until(kafka_config, expected=40))
    two = replay(kafka_config, "--out", str(tmp_path / "a.sqlite"), "--check", *checkpoints)
    assert two.returncode == 0, two.stderr
    report = json.loads(two.stdout)
    assert report["resumed_from"] == json.loads(one.stdout)["checkpoint"]
    assert (report["events"], report["events_before"], report["differences"]) == (len(second), len(first), [])

    every = replay(kafka_config, "--out", str(tmp_path / "c.sqlite"), "--every", "5")
    assert (
        every.returncode == 2
        and "--every: keeps a checkpoint current, so it needs --checkpoints" in every.stderr
    )
    shards = replay(kafka_config, "--out", str(tmp_path / "c.sqlite"), "--processes", "2", *checkpoints)
    assert (
        shards.returncode == 2
        and "--processes: a rebuild from checkpoints runs in one process" in shards.stderr
    )
