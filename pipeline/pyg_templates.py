"""PyG's generated ``propagate`` modules, kept in memory instead of the temporary directory.

PyG writes a ``propagate()`` per ``MessagePassing`` class to ``$TMPDIR`` and never deletes it.
:func:`install` wraps PyG's ``module_from_template``: once imported, the module's source goes to
:mod:`linecache` (tracebacks and ``inspect.getsource`` still show it) and the file is deleted.
"""
from __future__ import annotations

import contextlib
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
            with contextlib.suppress(OSError):
                os.unlink(path)
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
