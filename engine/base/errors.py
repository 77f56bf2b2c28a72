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


NON_FINITE = "produced NaN/infinite scores"
"""What :func:`non_finite_message` says, and :func:`request_failed` reads."""


class RequestFailedError(EngineError):
    """A request ended with an error (``Finished(reason="error")``): the one shape every client
    of the engine service gets, raised by :func:`request_failed`. ``finished`` holds the run up to
    the failure, so the caller can keep it, marked failed."""

    def __init__(self, message: str, finished=None) -> None:
        super().__init__(message)
        self.finished = finished


class RequestOutOfMemoryError(OutOfMemoryError, RequestFailedError):
    """A request ended because the device ran out of memory (``finished``: its run so far)."""


OUT_OF_MEMORY = "Out of memory on"
"""How the engine service's message for a step that ran out of memory begins."""


class NonFiniteError(RequestFailedError):
    """The model's scores became NaN or infinite: its answer from there on would be noise
    (``finished``: the run up to the last finite token)."""


def request_failed(finished) -> RequestFailedError:
    """The error a failed request's ``Finished`` raises: :class:`NonFiniteError` where its scores
    stopped being finite (:func:`non_finite_message` said so), :class:`RequestOutOfMemoryError`
    where its step ran out of memory, else :class:`RequestFailedError`."""
    message = finished.error or "The engine failed on this request."
    kind = (NonFiniteError if NON_FINITE in message else RequestOutOfMemoryError if message.startswith(OUT_OF_MEMORY)
            else RequestFailedError)
    return kind(message, finished)


class EndpointError(EngineError):
    """A server could not be reached, refused, or broke off an answer. ``finished`` holds the
    answer so far when the stream broke mid-way (``reason == "error"``): kept, marked incomplete."""

    def __init__(self, message: str, finished=None, status: int | None = None) -> None:
        super().__init__(message)
        self.finished = finished
        self.status = status


class EndpointAuthError(EndpointError):
    """The server answered 401/403: the API key is missing or wrong."""


def non_finite_message(precision: str, model: str, index: int) -> str:
    """What to tell a person whose generation produced NaN/inf scores at token ``index``."""
    other = "fp32" if precision != "fp32" else "bf16 or another model file"
    return (f"{model} in {precision} {NON_FINITE} at token {index + 1}, so the generation was "
            f"stopped (what came after would be noise). This precision overflows or breaks for this model: "
            f"try {other}.")


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA raises torch.OutOfMemoryError; the CPU and MPS raise RuntimeErrors that say so."""
    import torch  # only here: the errors themselves import nothing heavy

    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)
