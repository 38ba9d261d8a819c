"""Apache RocketMQ 5 as the gateway's storage: the adapter and its parts."""
