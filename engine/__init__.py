"""Inference Workbench engine: loads models and streams generation events.

Pure Python + torch; never imports Qt. Heavy modules (torch, transformers) are
imported by the submodules that need them, so ``import engine`` stays cheap.
"""

__version__ = "0.1.0"
