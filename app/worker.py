"""The engine in its own thread: one long-lived worker object per model slot.

The worker is created without a parent and moved to a QThread (a parented object can't
be moved). The GUI asks through ``*_requested`` signals, which Qt queues into the
worker's thread; results come back as signals, queued into the GUI thread. Stopping is
a :class:`CancelToken` the GUI sets directly: it must not wait in a queue behind the
generation it is meant to stop.
"""

from __future__ import annotations

import time

from PySide6.QtCore import QObject, QThread, Signal, Slot

from engine.cancel import CancelToken
from engine.errors import EngineError
from engine.events import Finished, Prefilled, TokenGenerated


BATCH_S = 0.02
"""Tokens cross to the GUI thread in batches at most this often (a fast model makes hundreds
a second; the GUI thread would wake for each, and on few cores that slows the model)."""


class EngineWorker(QObject):
    devices_found = Signal(object)  # list[str]
    models_found = Signal(object)  # list[ModelEntry]
    load_progressed = Signal(object)  # LoadProgress
    loaded = Signal(object)  # Loaded
    load_failed = Signal(object)  # Exception
    unloaded = Signal()
    generation_started = Signal()
    prefilled = Signal(object)  # Prefilled
    tokens_generated = Signal(object)  # tuple[TokenGenerated, ...], in order
    generation_finished = Signal(object)  # Finished
    generation_failed = Signal(object)  # Exception
    predicted = Signal(object, object)  # LoadRequest, MemoryPrediction | None
    scored = Signal(object, object)  # prompt ids, teacher-forced logprobs | None

    def __init__(self) -> None:
        super().__init__()  # no parent: moveToThread needs a parentless object
        self._model = None

    @Slot()
    def probe(self) -> None:
        """Find devices and cached models here, so the GUI thread never imports torch."""
        from engine.devices import available_devices
        from engine.sources import list_models

        self.devices_found.emit(available_devices())
        try:
            self.models_found.emit(list_models())
        except Exception:  # a damaged HF cache must not stop the app; the default still works
            self.models_found.emit([])

    @Slot(object, object)
    def load(self, request, cancel: CancelToken) -> None:
        from engine.loading import load_model

        self._drop_model()
        try:
            model = load_model(request, progress=self.load_progressed.emit, cancel=cancel)
        except Exception as exc:  # errors cross the thread as data
            self.load_failed.emit(exc)
            return
        self._model = model
        self.loaded.emit(model.info)

    @Slot(object)
    def predict(self, request) -> None:
        """Memory this load would need (from the config on disk), before loading anything."""
        from engine.estimate import config_for, predict

        try:
            config = config_for(request.model)
            prediction = None if config is None else predict(config, request.precision, request.device)
        except Exception:  # a prediction is advice: never let it block a load
            prediction = None
        self.predicted.emit(request, prediction)

    @Slot(object, object)
    def score(self, request, token_ids) -> None:
        """Teacher-force ``token_ids`` after ``request``'s prompt with this model."""
        from engine.compare import teacher_forced_logprobs

        if self._model is None:
            self.scored.emit([], None)
            return
        try:
            prompt_ids = self._model.encode(request)
            self.scored.emit(prompt_ids, teacher_forced_logprobs(self._model, prompt_ids, list(token_ids)))
        except Exception:
            self.scored.emit([], None)

    @Slot()
    def unload(self) -> None:
        self._drop_model()
        self.unloaded.emit()

    def _drop_model(self) -> None:
        if self._model is not None:
            model, self._model = self._model, None
            model.close()

    @Slot(object, object)
    def generate(self, request, cancel: CancelToken) -> None:
        if self._model is None:
            self.generation_failed.emit(EngineError("No model is loaded: load one first."))
            return
        self.generation_started.emit()
        batch: list[TokenGenerated] = []
        sent = time.perf_counter()
        try:
            for event in self._model.generate(request, cancel):
                if isinstance(event, TokenGenerated):
                    batch.append(event)
                    now = time.perf_counter()
                    if now - sent >= BATCH_S:
                        self.tokens_generated.emit(tuple(batch))
                        batch.clear()
                        sent = now
                elif isinstance(event, Prefilled):
                    self.prefilled.emit(event)
                elif isinstance(event, Finished):
                    if batch:
                        self.tokens_generated.emit(tuple(batch))
                        batch.clear()
                    self.generation_finished.emit(event)
        except Exception as exc:
            if batch:
                self.tokens_generated.emit(tuple(batch))
            self.generation_failed.emit(exc)


class ModelSession(QObject):
    """The GUI's handle on one worker thread: load, generate, stop, unload, shut down.

    It lives in the GUI thread and re-emits the worker's signals as its own, so whatever
    connects to a session (widgets, tests) runs in the GUI thread, even a plain function.
    """

    load_requested = Signal(object, object)
    generate_requested = Signal(object, object)
    unload_requested = Signal()
    probe_requested = Signal()
    predict_requested = Signal(object)
    score_requested = Signal(object, object)

    devices_found = Signal(object)
    models_found = Signal(object)
    load_progressed = Signal(object)
    loaded = Signal(object)
    load_failed = Signal(object)
    unloaded = Signal()
    generation_started = Signal()
    prefilled = Signal(object)
    tokens_generated = Signal(object)
    generation_finished = Signal(object)
    generation_failed = Signal(object)
    predicted = Signal(object, object)
    scored = Signal(object, object)

    def __init__(self, name: str = "engine", parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.thread = QThread()
        self.thread.setObjectName(f"{name}-worker")
        self.worker = EngineWorker()
        self.worker.moveToThread(self.thread)
        self.load_requested.connect(self.worker.load)
        self.generate_requested.connect(self.worker.generate)
        self.unload_requested.connect(self.worker.unload)
        self.probe_requested.connect(self.worker.probe)
        self.predict_requested.connect(self.worker.predict)
        self.score_requested.connect(self.worker.score)
        for name in ("devices_found", "models_found", "load_progressed", "loaded", "load_failed", "unloaded",
                     "generation_started", "prefilled", "tokens_generated", "generation_finished",
                     "generation_failed", "predicted", "scored"):
            # signal to signal, across threads: queued into this (the GUI) thread
            getattr(self.worker, name).connect(getattr(self, name))
        self.thread.finished.connect(self.worker.deleteLater)
        self._load_cancel: CancelToken | None = None
        self._generation_cancel: CancelToken | None = None
        self.thread.start()

    def load(self, request) -> None:
        self._load_cancel = CancelToken()
        self.load_requested.emit(request, self._load_cancel)

    def cancel_load(self) -> None:
        if self._load_cancel is not None:
            self._load_cancel.cancel()

    def generate(self, request) -> None:
        self._generation_cancel = CancelToken()
        self.generate_requested.emit(request, self._generation_cancel)

    def stop(self) -> None:
        if self._generation_cancel is not None:
            self._generation_cancel.cancel()

    def unload(self) -> None:
        self.unload_requested.emit()

    def shutdown(self, timeout_ms: int = 2000) -> bool:
        """Cancel whatever runs, end the thread; ``False`` if it did not end in time."""
        self.cancel_load()
        self.stop()
        self.thread.quit()
        return self.thread.wait(timeout_ms)
