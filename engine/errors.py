"""Typed errors the engine raises. Each message is written for a person to read."""

from __future__ import annotations


class EngineError(Exception):
    """Base class: anything the engine refuses or fails to do, with a human message."""


class ModelNotFoundError(EngineError):
    """A path that does not exist."""


class NotAModelError(EngineError):
    """A path that exists but holds no model we can load."""


class CorruptModelError(EngineError):
    """A model file that is truncated, corrupt or inconsistent."""


class HubModelUnavailableError(EngineError):
    """A hub id that is neither in the local cache nor reachable."""


class UnsafeCheckpointError(EngineError):
    """A checkpoint that needs an explicit opt-in (pickle weights, remote code)."""


class DeviceUnavailableError(EngineError):
    """A device that this machine or this torch build does not have."""


class UnsupportedPrecisionError(EngineError):
    """A precision that is unknown, or that the chosen device cannot run."""


class InvalidRequestError(EngineError, ValueError):
    """A generation request or parameter that makes no sense."""


class PromptTooLongError(InvalidRequestError):
    """A prompt that does not fit the model's context window."""


class CancelledError(EngineError):
    """The caller cancelled a load or a download."""


class DownloadError(EngineError):
    """Fetching the default model failed."""


class IntegrityError(DownloadError):
    """A downloaded or cached file whose SHA-256 is not the expected one."""


class OutOfMemoryError(EngineError):
    """The device ran out of memory."""
