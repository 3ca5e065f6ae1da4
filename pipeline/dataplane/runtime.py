"""Open the data plane a ``DataPlaneConfig`` names, for the lifetime of a ``async with``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from pipeline.dataplane.addresses import DataPlaneAddresses
from pipeline.dataplane.config import DataPlaneConfig
from pipeline.dataplane.embedded import embedded_data_plane
from pipeline.dataplane.transferqueue import TransferQueueDataPlane


@contextlib.asynccontextmanager
async def open_data_plane(config: DataPlaneConfig) -> AsyncIterator[TransferQueueDataPlane]:
    """``embedded``: start one here and publish its addresses to ``config.addresses_path``;
    ``attach``: join the one published in ``config.addresses_file`` if set, else in
    ``TOKENTRAIL_DATAPLANE_ADDRESSES``, else in ``data_dir/dataplane.json``;
    ``ray``: join TransferQueue on the Ray cluster at ``config.ray_address``.

    On exit only what this call started is stopped; an attached data plane keeps running.
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
        if config.addresses_file is not None:  # named explicitly: it wins
            addresses = DataPlaneAddresses.read(config.addresses_file)
        else:
            addresses = DataPlaneAddresses.from_env() or DataPlaneAddresses.read(config.addresses_path)
        plane = await TransferQueueDataPlane.attach(addresses, timeout_s=config.timeout_s, **options)
    else:
        plane = await TransferQueueDataPlane.attach_ray(
            config.ray_address, namespace=config.ray_namespace, timeout_s=config.timeout_s, **options
        )
    async with plane:
        yield plane
