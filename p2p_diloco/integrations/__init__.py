"""DiLoCo inside other training frameworks: :class:`DiLoCoCallback` for a Hugging Face ``Trainer``.

Imported on first use, so that ``import p2p_diloco.integrations`` needs transformers only for the callback.
"""

__all__ = ["DiLoCoCallback"]


def __getattr__(name: str):
    if name == "DiLoCoCallback":
        from p2p_diloco.integrations.transformers_trainer import DiLoCoCallback

        return DiLoCoCallback
    raise AttributeError(f"module 'p2p_diloco.integrations' has no attribute {name!r}")
