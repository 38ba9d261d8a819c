"""The storage backend the settings choose (`store`): opened here for the composition root.

embedded  the CommitLog store under `data_dir` (gateway/storage/embedded.py), one machine.
rocketmq  messages and state on an Apache RocketMQ 5 broker (gateway/storage/rocketmq/adapter.py);
an
          embedded store under `data_dir` is still opened beside it (see that module).
"""

from __future__ import annotations

from gateway.cluster.membership import new_node_id
from gateway.config import GatewaySettings
from gateway.storage.embedded import open_storage
from gateway.storage.port import Storage


async def open_backend(settings: GatewaySettings) -> Storage:
    """Open the configured backend; StorageUnavailable says what to fix when it cannot be."""
    local = open_storage(settings)
    if settings.store == "embedded":
        return local
    from gateway.storage.rocketmq.start import open_rocketmq

    try:
        return await open_rocketmq(settings, local, node_id=settings.node_id or new_node_id())
    except BaseException:
        local.close()
        raise
