"""The torch.compile backend "graphar", and `install()` for users who keep backend="inductor"."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch._inductor import config as inductor_config

from graphar.config import MODES, Config
from graphar.errors import SettingError
from graphar.passes import GrapharPass
from graphar.passes.manager import watch_compiles

BACKEND_NAME = "graphar"


def _mode(mode: str | None, from_options: str | None) -> str | None:
    if mode is not None and from_options is not None:
        raise SettingError(f"mode={mode!r} and options['mode']={from_options!r}: give one")
    mode = mode if mode is not None else from_options
    if mode is not None and mode not in MODES:
        raise SettingError(f"mode={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def graphar_backend(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> Callable[..., Any]:
    """Inductor with graphar's pass at `post_grad_custom_post_pass`.

    `options` takes graphar's `Config` fields and `"mode"`; every other key is an Inductor config
    patch. torch.compile refuses `mode=` together with `options=`, so `options={"mode":
    "reduce-overhead", ...}` is how to get Inductor's CUDA graphs with graphar options.
    """
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    options = dict(options or {})
    mode = _mode(mode, options.pop("mode", None))
    config = Config.from_options(options)
    patches = dict(list_mode_options(mode)) if mode else {}
    patches.update(config.inductor)
    previous = patches.pop("post_grad_custom_post_pass", None) or inductor_config.post_grad_custom_post_pass
    patches["post_grad_custom_post_pass"] = GrapharPass(config, _before_graphar(previous))  # the backend's config wins
    watch_compiles()
    return compile_fx(gm, example_inputs, config_patches=patches)


def _before_graphar(installed: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """The pass installed before graphar's: `installed` itself, unless it is graphar's (install())."""
    return installed.previous if isinstance(installed, GrapharPass) else installed


def register() -> None:
    """Register the backend name, unless the `torch_dynamo_backends` entry point already serves it."""
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend

    if BACKEND_NAME in _COMPILER_FNS or _BACKENDS.get(BACKEND_NAME) is not None:
        return
    register_backend(graphar_backend, BACKEND_NAME)


class _Installed:
    """What `install()` returns: the installed pass, and a clear refusal of the `with` form."""

    def __init__(self, graphar_pass: GrapharPass) -> None:
        self.graphar_pass = graphar_pass

    def __enter__(self) -> None:
        raise TypeError(
            "graphar.install() is not a context manager: torch.compile compiles a model at its first "
            "call, after a with-block would have removed the pass. Call graphar.install() before the "
            "first call and graphar.uninstall() when done, or use backend='graphar'."
        )

    def __exit__(self, *exc: object) -> None:  # pragma: no cover  (__enter__ always raises)
        pass


def install(config: Config | None = None, **options: Any) -> _Installed:
    """Add graphar's pass to Inductor for `backend="inductor"` (and every backend built on Inductor).

    It stays until `uninstall()`; calling it again replaces the options. Takes graphar's `Config`
    fields, validated here. A pass that was installed before graphar's still runs first.
    """
    if config is not None and options:
        raise SettingError("install() takes a Config or options, not both")
    graphar_pass = GrapharPass(config or Config(**options), _before_graphar(inductor_config.post_grad_custom_post_pass))
    inductor_config.post_grad_custom_post_pass = graphar_pass
    watch_compiles()
    return _Installed(graphar_pass)


def uninstall() -> None:
    """Remove graphar's pass from Inductor, restoring the pass installed before it (if any)."""
    inductor_config.post_grad_custom_post_pass = _before_graphar(inductor_config.post_grad_custom_post_pass)
