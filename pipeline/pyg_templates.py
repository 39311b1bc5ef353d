"""PyG's generated ``propagate`` modules, kept in memory instead of the temporary directory.

PyTorch Geometric renders a specialised ``propagate()`` for each ``MessagePassing`` class from a
jinja template the first time the class is built (or unpickled), writes it to
``$TMPDIR/<module>_<Class>_propagate_<random>.py`` and imports it from there; the file is never
deleted, so every process that builds or loads a SAT model (the driver, each Ray Train worker,
``satp predict``) leaves one ``sat.extractors_EdgeGCNConv_propagate_*.py`` behind. PyG offers no
switch for it (its own ``TemporaryDirectory`` argument is unused).

:func:`install` wraps PyG's ``module_from_template``: once the module is imported, its source is
registered with :mod:`linecache` (tracebacks and ``inspect.getsource``, which TorchScript uses,
still show it: entries without a modification time are never invalidated) and the file is
deleted at once, so nothing is left even when the process is killed later.
"""
from __future__ import annotations

import linecache
import os

_INSTALLED = False


def _in_memory(original):
    def module_from_template(module_name, template_path, tmp_dirname, **kwargs):
        import sys

        known = module_name in sys.modules
        module = original(module_name, template_path, tmp_dirname, **kwargs)
        path = getattr(module, "__file__", None)
        if not known and path and os.path.isfile(path):
            with open(path) as fh:
                lines = fh.readlines()
            linecache.cache[path] = (sum(map(len, lines)), None, lines, path)
            try:
                os.unlink(path)
            except OSError:
                pass
        return module

    module_from_template.__wrapped__ = original
    return module_from_template


def install() -> None:
    """Patch PyG once in this process (before any model is built or loaded)."""
    global _INSTALLED
    if _INSTALLED:
        return
    import torch_geometric.nn.conv.message_passing as message_passing
    import torch_geometric.template as template

    patched = _in_memory(template.module_from_template)
    template.module_from_template = patched
    message_passing.module_from_template = patched  # imported by name there
    _INSTALLED = True
