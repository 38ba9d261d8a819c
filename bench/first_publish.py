"""CPU of a first publish on a new topic against the same publish again, in process.

``python -m bench.first_publish [--topics N] [--rounds R]``: a fleet of N new devices (each its
own ``site/<k>/dev/<d>/temp``) publishes once through the gateway's publish path (route, topic
check, property block, store append), then the same topics again; R rounds, medians of CPU time
per publish. A fleet coming online, or every device after a gateway restart, pays the first
figure once per topic, all at once.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

from gateway.config import GatewaySettings
from gateway.messages.publishing import PublishPath
from gateway.messages.recent import RecentMessages
from gateway.messages.records import PublishProperties
from gateway.protocol import Publish
from gateway.stats import GatewayStats
from gateway.storage.embedded import open_storage

TURN = 20  # publishes per append, about a fleet turn's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topics", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    n = args.topics
    with tempfile.TemporaryDirectory() as tmp:
        store = open_storage(GatewaySettings(data_dir=Path(tmp) / "data"))
        path = PublishPath(store, RecentMessages(), GatewayStats())
        for f in ["site/#", "site/+/dev/+/temp", *(f"site/{k}/#" for k in range(5))]:
            path.add_filter(f)

        def run(pubs: list[Publish], blocks: list[PublishProperties], first: bool) -> float:
            t0 = time.process_time_ns()
            for i in range(0, n, TURN):
                if first:
                    for p in pubs[i : i + TURN]:
                        path.publish_route(p.topic)  # validated and routed, as the read path does
                path.append_publishes(pubs[i : i + TURN], blocks[i : i + TURN])
            return (time.process_time_ns() - t0) / n / 1e3

        gc.disable()
        firsts, agains = [], []
        for r in range(args.rounds):
            devices = range(r * n, (r + 1) * n)
            topics = [f"site/{d % 50}/dev/{d}/temp" for d in devices]
            blocks = [PublishProperties(f"dev-{d}", store.encode_properties) for d in devices]
            pubs = [Publish(topic=t, payload=b"x" * 64, qos=1, packet_id=1) for t in topics]
            firsts.append(run(pubs, blocks, True))
            again = [Publish(topic=t, payload=b"x" * 64, qos=1, packet_id=2) for t in topics]
            agains.append(run(again, blocks, False))
        gc.enable()
        store.close()
    first_us, again_us = statistics.median(firsts), statistics.median(agains)
    print(
        f"{n:,} topics x {args.rounds} rounds, CPU per publish (medians): first {first_us:.2f} us, "
        f"again {again_us:.2f} us, a new topic's extra {first_us - again_us:.2f} us"
    )


if __name__ == "__main__":
    main()
