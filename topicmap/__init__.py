"""MQTT topic mapping onto a parent topic and light queues: validation, naming, routing."""

from topicmap.errors import TopicError
from topicmap.naming import (
    EMPTY_PARENT,
    LMQ_PREFIX,
    MAX_STORE_NAME_LENGTH,
    NameTable,
    filter_of,
    is_store_name,
    parent_topic,
    queue_name,
)
from topicmap.router import Router
from topicmap.topic import MAX_TOPIC_BYTES, Topic, TopicFilter, matches_levels

__all__ = [
    "EMPTY_PARENT",
    "LMQ_PREFIX",
    "MAX_STORE_NAME_LENGTH",
    "MAX_TOPIC_BYTES",
    "NameTable",
    "Router",
    "Topic",
    "TopicError",
    "TopicFilter",
    "filter_of",
    "is_store_name",
    "matches_levels",
    "parent_topic",
    "queue_name",
]
