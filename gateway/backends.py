"""The storage backend the settings choose (`store`): opened here for the composition root.

embedded  the CommitLog store under `data_dir` (gateway/embedded.py), one machine.
rocketmq  messages and state on an Apache RocketMQ 5 broker (gateway/rocketmq_storage.py); an
          embedded store under `data_dir` is still opened beside it (see that module).
"""

from __future__ import annotations

from gateway.config import GatewaySettings
from gateway.embedded import open_storage
from gateway.membership import new_node_id
from gateway.storage import Storage


async def open_backend(settings: GatewaySettings) -> Storage:
    """Open the configured backend; StorageUnavailable says what to fix when it cannot be."""
    local = open_storage(settings)
    if settings.store == "embedded":
        return local
    from gateway.rocketmq_storage import open_rocketmq

    try:
        return await open_rocketmq(settings, local, node_id=settings.node_id or new_node_id())
    except BaseException:
        local.close()
        raise
