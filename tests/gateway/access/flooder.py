"""A device publishing QoS 1 as fast as the gateway acknowledges (a window of WINDOW
unacknowledged publishes), for the quota tests: `python -m tests.gateway.access.flooder PORT
SECONDS`. Payloads are 1, 2, 3, ...; at the end it prints `acked N`: publishes 1..N were
acknowledged."""

from __future__ import annotations

import sys
import time
from collections import deque

import paho.mqtt.client as mqtt

WINDOW = 100


def main() -> None:
    port, seconds = int(sys.argv[1]), float(sys.argv[2])
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="flooder", protocol=mqtt.MQTTv5)
    c.max_inflight_messages_set(WINDOW)
    c.connect("127.0.0.1", port, keepalive=60)
    c.loop_start()
    pending: deque[mqtt.MQTTMessageInfo] = deque()
    acked = 0
    seq = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        while len(pending) >= WINDOW:
            oldest = pending[0]
            oldest.wait_for_publish(max(0.001, end - time.monotonic()))
            if not oldest.is_published():
                break
            pending.popleft()
            acked += 1
        if len(pending) >= WINDOW:
            break
        seq += 1
        pending.append(c.publish("flood/x", b"%d" % seq, qos=1))
    while pending and pending[0].is_published():
        pending.popleft()
        acked += 1
    print(f"acked {acked}", flush=True)
    c.disconnect()
    c.loop_stop()


if __name__ == "__main__":
    main()
