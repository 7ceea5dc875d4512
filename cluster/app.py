"""The public import path of the Serve application: ``import_path: cluster.app:build_app``.

Serve configs (every ``deploy/*.yaml``, and users' own) name this path, so it stays put while
the ingress lives in :mod:`cluster.serving.ingress`; this module only re-exports
:func:`~cluster.serving.ingress.build_app`.
"""

from cluster.serving.ingress import build_app

__all__ = ["build_app"]
