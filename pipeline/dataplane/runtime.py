"""Open the data plane a ``DataPlaneConfig`` names, for the lifetime of a ``async with``."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pipeline.dataplane.addresses import DataPlaneAddresses
from pipeline.dataplane.config import ENV_MODE, DataPlaneConfig
from pipeline.dataplane.embedded import embedded_data_plane
from pipeline.dataplane.reattach import ReattachingDataPlane
from pipeline.dataplane.transferqueue import TransferQueueDataPlane


@contextlib.asynccontextmanager
async def open_data_plane(
    config: DataPlaneConfig,
) -> AsyncIterator[TransferQueueDataPlane | ReattachingDataPlane]:
    """``embedded``: start one here and publish its addresses to ``config.addresses_path``;
    ``attach``: join the one published in ``config.addresses_file`` if set, else in
    ``TOKENTRAIL_DATAPLANE_ADDRESSES``, else in ``data_dir/dataplane.json``;
    ``ray``: join TransferQueue on the Ray cluster at ``config.ray_address``.

    An attached data plane named by a file follows its owner across restarts
    (``ReattachingDataPlane``). On exit only what this call started is stopped; an
    attached data plane keeps running.
    """
    options = {"staging_partition": config.staging_partition, "samples_partition": config.samples_partition}
    if config.mode == "embedded":
        async with embedded_data_plane(
            addresses_file=config.addresses_path,
            host=config.host,
            timeout_s=config.timeout_s,
            staging_partition=config.staging_partition,
            samples_partition=config.samples_partition,
        ) as plane:
            yield plane
        return
    if config.mode == "attach":
        path = config.addresses_file  # named explicitly: it wins
        exported = None if path is not None else DataPlaneAddresses.from_env()
        if exported is not None:
            plane = await TransferQueueDataPlane.attach(exported, timeout_s=config.timeout_s, **options)
        else:
            path = path or config.addresses_path
            attach_options: dict[str, Any] = {"timeout_s": config.timeout_s, **options}
            first = await TransferQueueDataPlane.attach(DataPlaneAddresses.read(path), **attach_options)
            following = ReattachingDataPlane(
                first,
                path,
                options=attach_options,
                restage_grace_s=config.restage_grace_s,
                owner_wait_s=config.owner_wait_s,
            )
            watcher = asyncio.create_task(following.watch(), name="dataplane-follower")
            try:
                yield following
            finally:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
                await following.close()
            return
    else:
        plane = await TransferQueueDataPlane.attach_ray(
            config.ray_address, namespace=config.ray_namespace, timeout_s=config.timeout_s, **options
        )
    async with plane:
        yield plane


@contextlib.asynccontextmanager
async def attach_data_plane(
    addresses_file: Path | None,
) -> AsyncIterator[TransferQueueDataPlane | ReattachingDataPlane]:
    """The data plane another process runs (what ``--dataplane-addresses`` names); this
    client closes on exit. ``addresses_file`` wins; otherwise the ``TOKENTRAIL_DATAPLANE_*``
    environment decides (attach mode unless it names another one)."""
    overrides: dict[str, object] = {}
    if addresses_file is not None:
        overrides = {"mode": "attach", "addresses_file": addresses_file}
    elif ENV_MODE not in os.environ:
        overrides = {"mode": "attach"}
    async with open_data_plane(DataPlaneConfig.from_env(**overrides)) as plane:
        yield plane
