"""What happens to sessions and subscriptions over time, from CONNECT and SUBSCRIBE on."""
