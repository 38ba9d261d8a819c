"""The storage port and its adapters: the embedded store and Apache RocketMQ."""
