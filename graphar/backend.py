"""The torch.compile backend "graphar" and `install()` for users who keep backend="inductor"."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch._inductor import config as inductor_config

from graphar.config import Config
from graphar.passes import GrapharPass

BACKEND_NAME = "graphar"


def graphar_backend(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> Callable[..., Any]:
    """Inductor with graphar's pass at `post_grad_custom_post_pass`.

    `options` takes graphar's `Config` fields; every other key is an Inductor config patch.
    `mode` is torch.compile's mode ("reduce-overhead" turns on Inductor's CUDA graphs).
    """
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    config = Config.from_options(options)
    patches = dict(list_mode_options(mode)) if mode else {}
    patches.update(config.inductor)
    previous = patches.pop("post_grad_custom_post_pass", None) or inductor_config.post_grad_custom_post_pass
    patches["post_grad_custom_post_pass"] = GrapharPass(config, previous)
    return compile_fx(gm, example_inputs, config_patches=patches)


def register() -> None:
    """Register the backend name, unless the `torch_dynamo_backends` entry point already serves it."""
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend

    if BACKEND_NAME in _COMPILER_FNS or _BACKENDS.get(BACKEND_NAME) is not None:
        return
    register_backend(graphar_backend, BACKEND_NAME)


class install:
    """Install graphar's pass into Inductor's config, for `backend="inductor"` users.

    Takes effect at once; used as a context manager it restores the previous pass on exit.
    Accepts the same options as the backend's graphar fields (`graphar.Config`).
    """

    def __init__(self, config: Config | None = None, **options: Any) -> None:
        self.previous = inductor_config.post_grad_custom_post_pass
        self.graphar_pass = GrapharPass(config or Config(**options), self.previous)
        inductor_config.post_grad_custom_post_pass = self.graphar_pass

    def __enter__(self) -> GrapharPass:
        return self.graphar_pass

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def uninstall(self) -> None:
        if inductor_config.post_grad_custom_post_pass is self.graphar_pass:
            inductor_config.post_grad_custom_post_pass = self.previous
