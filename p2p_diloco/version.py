"""The package's version (pyproject.toml's), in a module of its own: any module may import it without the
package's ``__init__`` (which offers :class:`p2p_diloco.DiLoCo`)."""

__version__ = "0.1.0"
