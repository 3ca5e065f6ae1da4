"""The staging janitor deletes what nobody else will, and nothing a rollout still needs."""

from __future__ import annotations

import asyncio

import pytest
from rowkit import text_row

from stages.finalize.janitor import JanitorConfig, StagingJanitor
from stages.finalize.stage import FinalizerStage
from stages.memory import MemoryDataPlane, RecordingSink
from stages.ports import STAGING_PARTITION
from stages.recent import RecentIds


def planted(*keys: str) -> MemoryDataPlane:
    plane = MemoryDataPlane()
    asyncio.run(plane.put_calls([text_row(*key.split("/")) for key in keys]))
    return plane


def keys(plane: MemoryDataPlane) -> list[str]:
    return asyncio.run(plane.list_keys(STAGING_PARTITION))


def test_rows_of_finalized_rollouts_go_at_once_others_after_the_ttl() -> None:
    plane = planted("done/c1", "done/c2", "open/c1", "orphan/c9")
    finalized = RecentIds()
    finalized.add("done")
    now = [1_000.0]
    config = JanitorConfig(ttl_s=100.0, sweep_every_s=10.0)
    janitor = StagingJanitor(plane, finalized, config, clock=lambda: now[0])

    def sweep_at(t: float) -> None:
        now[0] = t
        asyncio.run(janitor.maybe_sweep())

    sweep_at(1_000.0)
    assert keys(plane) == ["open/c1", "orphan/c9"]
    sweep_at(1_005.0)  # not due yet: nothing looked at
    assert janitor.stats.sweeps == 1
    asyncio.run(plane.delete_calls(["open/c1"]))  # the finalizer finished it meanwhile
    sweep_at(1_099.0)
    assert keys(plane) == ["orphan/c9"]  # seen 99 s ago: kept
    sweep_at(1_110.0)
    assert keys(plane) == []
    assert (janitor.stats.finished, janitor.stats.expired) == (2, 1)


def test_a_sweep_looks_at_a_bounded_window_and_goes_on_where_it_stopped() -> None:
    plane = planted(*(f"r{i}/c" for i in range(5)))
    finalized = RecentIds()
    finalized.update(f"r{i}" for i in range(5))
    janitor = StagingJanitor(plane, finalized, JanitorConfig(max_keys=2))
    asyncio.run(janitor.sweep())
    assert keys(plane) == ["r2/c", "r3/c", "r4/c"]
    asyncio.run(janitor.sweep())
    assert keys(plane) == ["r4/c"]
    asyncio.run(janitor.sweep())
    assert keys(plane) == []


def test_a_dead_data_plane_skips_the_sweep() -> None:
    plane = planted("done/c1")
    plane.broken = True
    finalized = RecentIds()
    finalized.add("done")
    janitor = StagingJanitor(plane, finalized)
    asyncio.run(janitor.sweep())
    assert janitor.stats.errors == 1
    plane.broken = False
    assert keys(plane) == ["done/c1"]


def test_the_finalizer_sweeps_on_its_timer_and_exports_what_it_swept() -> None:
    plane = planted("done/c1")
    stage = FinalizerStage(plane, RecordingSink(), janitor=JanitorConfig())
    stage.answered.add("done")
    asyncio.run(stage.tick(0.0))  # log time says nothing: the janitor keeps its own clock
    assert keys(plane) == []
    assert stage.gauges().swept == {"finished": 1, "expired": 0}


@pytest.mark.parametrize("field,value", [("ttl_s", 0.0), ("sweep_every_s", -1.0), ("max_keys", 0)])
def test_bad_settings_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        JanitorConfig(**{field: value})


def test_a_row_ages_in_wall_time_whatever_log_time_the_stage_ticks_with() -> None:
    """A stage catching up ticks with old (even zero) log time, then the wall clock."""
    plane = planted("open/c1")
    stage = FinalizerStage(plane, RecordingSink(), janitor=JanitorConfig(ttl_s=60.0, sweep_every_s=0.001))

    async def go() -> None:
        await stage.tick(0.0)
        await asyncio.sleep(0.01)
        await stage.tick(1_800_000_000.0)

    asyncio.run(go())
    assert keys(plane) == ["open/c1"]
    assert stage.janitor is not None and stage.janitor.stats.sweeps == 2
