"""p2p-diloco: decentralized DiLoCo training over a hivemind DHT.

The library's entry point is :class:`p2p_diloco.DiLoCo` (:mod:`p2p_diloco.api`, docs/api.md): DiLoCo around
any PyTorch model and training loop. It is imported on first use, so that the CLI's commands start without
torch where they do not need it.
"""

from p2p_diloco.version import __version__

__all__ = ["DiLoCo", "DiLoCoError", "model_settings", "__version__"]


def __getattr__(name: str):
    if name in ("DiLoCo", "DiLoCoError", "model_settings"):
        from p2p_diloco import api

        return getattr(api, name)
    raise AttributeError(f"module 'p2p_diloco' has no attribute {name!r}")
