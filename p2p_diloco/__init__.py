"""p2p-diloco: decentralized DiLoCo training of transformers language models over a hivemind DHT."""

__version__ = "0.1.0"
