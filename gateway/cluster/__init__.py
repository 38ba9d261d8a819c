"""Cluster mode: several gateway nodes on one RocketMQ namespace, as one server."""
