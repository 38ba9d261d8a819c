"""The store's on-disk facts as analytics reads them, all taken from `store.format`.

analytics may import the store's format module (pure, no I/O) but nothing else of the store;
this module names the few derived values the fast segment parser needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from store import format as _fmt

MAGIC: Final = _fmt.MAGIC
BLANK_MAGIC: Final = _fmt.BLANK_MAGIC
PROPERTY_SEPARATOR: Final = _fmt.PROPERTY_SEPARATOR.encode()
NAME_VALUE_SEPARATOR: Final = _fmt.NAME_VALUE_SEPARATOR.encode()
QUEUE_SEPARATOR: Final = _fmt.MULTI_DISPATCH_SEPARATOR
KEY_DISPATCH: Final = _fmt.PROP_MULTI_DISPATCH
KEY_QUEUE_OFFSETS: Final = _fmt.PROP_MULTI_QUEUE_OFFSET

# The gateway's session records in the state log (store/statelog.py): key prefix + client id,
# value the session as JSON (gateway/session.py; analytics never imports it).
SESSION_KEY_PREFIX: Final = "session/"

# MQTT facts the gateway stores as properties (gateway contract; analytics never imports it).
KEY_TOPIC: Final = "mqtt.topic"
KEY_CLIENT: Final = "mqtt.client"
KEY_QOS: Final = "mqtt.qos"
KEY_RETAIN: Final = "mqtt.retain"

BORN_TIMESTAMP_POS: Final = _fmt.OFF_BORNTIMESTAMP
STORE_TIMESTAMP_POS: Final = _fmt.OFF_STORETIMESTAMP
PHYSICAL_OFFSET_POS: Final = _fmt.OFF_PHYSICALOFFSET
BODY_LENGTH_POS: Final = _fmt.OFF_BODYLENGTH
#: TOPICLENGTH sits right after the body: at HEADER_SIZE + body length.
TOPIC_LENGTH_POS: Final = _fmt.HEADER_SIZE
FIXED_OVERHEAD: Final = _fmt.FIXED_OVERHEAD
MIN_RECORD_SIZE: Final = _fmt.FIXED_OVERHEAD + 1 + _fmt.CRC_TRAILER_SIZE
#: The __CRC32# trailer ends every record: prefix, 10 digits, separator.
CRC_TRAILER_SIZE: Final = _fmt.CRC_TRAILER_SIZE
CRC_PREFIX: Final = _fmt.CRC_PREFIX
CRC_MASK: Final = _fmt.CRC_MASK
CQ_UNIT_SIZE: Final = _fmt.CQ_UNIT_SIZE
QUEUE_ID: Final = _fmt.QUEUE_ID
CONFIG_DIR: Final = _fmt.CONFIG_DIR

segment_start_offset = _fmt.parse_offset_file_name
decode_queue_dir = _fmt.decode_queue_dir
encode_queue_dir = _fmt.encode_queue_dir
parse_properties = _fmt.parse_properties
decode_record = _fmt.decode_record


def commitlog_dir(data_dir: Path) -> Path:
    return data_dir / _fmt.COMMITLOG_DIR


def consumequeue_dir(data_dir: Path) -> Path:
    return data_dir / _fmt.CONSUMEQUEUE_DIR
