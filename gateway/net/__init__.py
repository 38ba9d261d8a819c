"""Listeners: MQTT over TCP, TLS and WebSocket, each an asyncio Protocol that only moves bytes."""
