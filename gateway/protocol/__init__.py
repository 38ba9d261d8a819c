"""lmqtt package."""
