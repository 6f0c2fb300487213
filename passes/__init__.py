"""graphar's compiler passes (installed as the package `graphar.passes`).

`GrapharPass` is the one object Inductor sees: it runs at `post_grad_custom_post_pass` and owns the
list of rewrites, graphar's config and the cache key.
"""

from .manager import GrapharPass

__all__ = ["GrapharPass"]
