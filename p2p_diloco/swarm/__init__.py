"""Swarm: the DHT node, peer identity, and run progress records on the DHT."""
