"""Operators' views: inspect, replay export, metrics, the garbage-collector monitor."""
