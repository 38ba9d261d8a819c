"""Delivery: from a subscription's light queue to the client, by long polling."""
