"""MQTT topic mapping onto a parent topic and light queues: validation, naming, routing."""

# First of all (its import decides it): whether the mypyc-compiled modules run compiled.
import accelerators.compiled  # noqa: F401
from topicmap.errors import TopicError
from topicmap.naming import (
    EMPTY_PARENT,
    LMQ_PREFIX,
    MAX_STORE_NAME_LENGTH,
    NameTable,
    filter_of,
    is_store_name,
    parent_of_name,
    parent_topic,
    queue_name,
)
from topicmap.replay import (
    REPLAY_PREFIX,
    REPLAY_PROPERTY,
    ReplayFilter,
    is_parent_name,
    parse_replay_from,
    replay_parents,
    split_replay,
)
from topicmap.router import Router
from topicmap.topic import MAX_TOPIC_BYTES, Topic, TopicFilter, check_topic_name, matches_levels

__all__ = [
    "EMPTY_PARENT",
    "LMQ_PREFIX",
    "MAX_STORE_NAME_LENGTH",
    "MAX_TOPIC_BYTES",
    "REPLAY_PREFIX",
    "REPLAY_PROPERTY",
    "NameTable",
    "ReplayFilter",
    "Router",
    "Topic",
    "TopicError",
    "TopicFilter",
    "check_topic_name",
    "filter_of",
    "is_parent_name",
    "is_store_name",
    "matches_levels",
    "parent_of_name",
    "parent_topic",
    "parse_replay_from",
    "queue_name",
    "replay_parents",
    "split_replay",
]
