"""Installing the capture hooks into a Megatron-Core dynamic engine, if it has them.

The engine declares ``prompt_preparer`` and ``payload_stager`` on Megatron-LM main since
PR 7015; megatron-core 0.19.2 has neither. ``install_capture_hooks`` feature-detects
them, so an engine without them runs with token capture off (or, when capture is
required, refuses with ``HooksUnavailable``).
"""

from __future__ import annotations

import logging
from typing import Any

from stages.capture.megatron.preparer import MegatronPromptPreparer
from stages.capture.megatron.stager import MegatronPayloadStager

log = logging.getLogger(__name__)

HOOK_ATTRIBUTES = ("prompt_preparer", "payload_stager")
MISSING_HOOKS = (
    "this Megatron-Core version has no prompt_preparer/payload_stager hooks "
    "(added on Megatron-LM main, PR 7015)"
)


class HooksUnavailable(RuntimeError):
    """The engine has no capture hooks to install into."""


def install_capture_hooks(
    engine: Any,
    preparer: MegatronPromptPreparer,
    stager: MegatronPayloadStager,
    *,
    required: bool = False,
) -> bool:
    """Install both hooks if the engine has them; False (or ``HooksUnavailable``) if not.

    Megatron-LM main declares ``prompt_preparer`` and ``payload_stager`` on the dynamic
    engine and calls them on the model-parallel coordinator rank; installing them on the
    other ranks is harmless (they are never called there).
    """
    missing = [name for name in HOOK_ATTRIBUTES if not hasattr(engine, name)]
    if missing:
        message = (
            f"{MISSING_HOOKS}: {type(engine).__name__} (megatron-core {_megatron_version()}) "
            f"lacks {', '.join(missing)}; token capture is off for this engine"
        )
        if required:
            raise HooksUnavailable(message)
        log.warning(message)
        return False
    for name, hook in zip(HOOK_ATTRIBUTES, (preparer, stager), strict=True):
        current = getattr(engine, name)
        if current is not None and current is not hook:
            log.warning("replacing the engine's existing %s (%s)", name, type(current).__name__)
        setattr(engine, name, hook)
    return True


def _megatron_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return "not installed"


__all__ = ["MISSING_HOOKS", "HooksUnavailable", "install_capture_hooks"]
