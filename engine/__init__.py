"""Inference Workbench engine: loads models and streams generation events.

Pure Python + torch; never imports Qt. Heavy modules (torch, transformers) are
imported by the submodules that need them, so ``import engine`` stays cheap.
"""

from engine.storage.paths import cache_dir

__version__ = "0.1.0"


def _compiled_code_in_the_user_cache() -> None:
    """torch.compile's on-disk cache (inductor) defaults to /tmp, gone after a reboot; the fast
    path's compiled decode step belongs in our user cache. Set before torch is imported."""
    import os

    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")


_compiled_code_in_the_user_cache()
