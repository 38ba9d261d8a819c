"""lmqtt's benchmark suite: lmqtt against amqtt's broker and Mosquitto (``python -m bench``)."""
