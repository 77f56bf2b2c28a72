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
    sweep_stepped = Signal(object, object)  # batch size, BatchStep
    sweep_point = Signal(object)  # SweepPoint
    sweep_finished = Signal(object, object)  # list[SweepPoint], list[SweepSkip]
    sweep_failed = Signal(object)  # Exception
    speculation_events = Signal(object, object)  # "plain" | "speculative", tuple of events in order
    speculation_finished = Signal(object)  # the report dict
    speculation_failed = Signal(object)  # Exception
    compile_started = Signal()
    compile_finished = Signal(object)  # engine.fast.CompileReport (emitted from the compile thread)

    def __init__(self) -> None:
        super().__init__()  # no parent: moveToThread needs a parentless object
        self._model = None
        self._draft = None

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
        """Load ``request``; the model loaded now stays loaded and usable until the new one is
        ready, so a failed or cancelled load loses nothing (unless memory is too short to hold
        both: then it is unloaded first, and the progress says so)."""
        from engine.estimate import fits_beside_loaded
        from engine.events import LoadProgress
        from engine.loading import load_model

        if self._model is not None and not fits_beside_loaded(request.model, request.precision, request.device):
            self.load_progressed.emit(LoadProgress("unload", 0, 0, f"Not enough free memory to keep "
                                                   f"{self._model.info.name} while loading: unloading it first"))
            self._drop_model()
            self.unloaded.emit()
        try:
            model = load_model(request, progress=self.load_progressed.emit, cancel=cancel)
        except Exception as exc:  # errors cross the thread as data
            self.load_failed.emit(exc)
            return
        self._drop_model()
        self._model = model
        self.loaded.emit(model.info)
        if model.fast is not None:  # the fast path compiles its decode step while the model is usable
            self.compile_started.emit()
            model.fast.compile_in_background(self.compile_finished.emit)

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
    def drop_draft(self) -> None:
        """Free the speculative draft (its window closed); the model stays."""
        self._drop_draft()
        from engine.model import release_free_memory

        release_free_memory()

    @Slot()
    def unload(self) -> None:
        self._drop_model()
        self.unloaded.emit()

    def release(self) -> None:
        """Free the model and its draft (from the owner's thread once this one has ended)."""
        self._drop_model()

    def _drop_model(self) -> None:
        self._drop_draft()
        if self._model is not None:
            model, self._model = self._model, None
            if model.fast is not None:
                model.fast.stop_compiling(timeout=0)  # it ends after the size it is compiling now
            model.close()

    def _drop_draft(self) -> None:
        if self._draft is not None:
            draft, self._draft = self._draft, None
            draft.close()

    @Slot(object, object, object)
    def sweep(self, request, batches, cancel: CancelToken) -> None:
        """Batch sizes in turn; each point joins the run history for the cost explorer."""
        from engine.events import BatchStep
        from engine.sweep import record_points, run_sweep

        if self._model is None:
            self.sweep_failed.emit(EngineError("No model is loaded: load one first."))
            return
        sent = [0.0]
        steps: dict[int, list] = {}

        def on_event(batch: int, event) -> None:
            if not isinstance(event, BatchStep):
                return
            steps.setdefault(batch, []).append(event)
            now = time.perf_counter()
            if now - sent[0] >= BATCH_S:
                sent[0] = now
                self.sweep_stepped.emit(batch, event)

        try:
            points, skipped = run_sweep(self._model, request, batches, cancel, on_event=on_event,
                                        on_point=self.sweep_point.emit)
            if points:
                try:
                    record_points(self._model, points, len(self._model.encode(request)), steps)
                except OSError:
                    pass  # the history is a convenience: a read-only data folder must not fail the sweep
        except Exception as exc:
            self.sweep_failed.emit(exc)
            return
        self.sweep_finished.emit(points, skipped)

    @Slot(object, object, object, object, object)
    def speculate(self, request, draft_text, draft_tokens, compare_plain, cancel: CancelToken) -> None:
        """Speculative decoding with ``draft_text`` as the draft (kept loaded for the next run)."""
        from engine.speculative import load_draft, parse_draft, speculative_report

        if self._model is None:
            self.speculation_failed.emit(EngineError("No model is loaded: load one first."))
            return
        pending: list = []
        state = {"run": None, "sent": time.perf_counter()}

        def flush() -> None:
            if pending:
                self.speculation_events.emit(state["run"], tuple(pending))
                pending.clear()

        def on_event(run: str, event) -> None:
            if run != state["run"]:
                flush()
                state["run"] = run
            pending.append(event)
            now = time.perf_counter()
            if now - state["sent"] >= BATCH_S or isinstance(event, (Finished, Prefilled)):
                flush()
                state["sent"] = now

        try:
            spec = parse_draft(draft_text, self._model.info.precision)
            if self._draft is None or self._draft.spec != spec:
                self._drop_draft()
                self._draft = load_draft(spec, self._model, cancel=cancel)
            result = speculative_report(self._model, self._draft, request, draft_tokens, compare_plain, cancel,
                                        on_event, record=True)
        except Exception as exc:
            flush()
            self.speculation_failed.emit(exc)
            return
        flush()
        self.speculation_finished.emit(result)

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
    drop_draft_requested = Signal()
    probe_requested = Signal()
    predict_requested = Signal(object)
    score_requested = Signal(object, object)
    sweep_requested = Signal(object, object, object)
    speculate_requested = Signal(object, object, object, object, object)

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
    sweep_stepped = Signal(object, object)
    sweep_point = Signal(object)
    sweep_finished = Signal(object, object)
    sweep_failed = Signal(object)
    speculation_events = Signal(object, object)
    speculation_finished = Signal(object)
    speculation_failed = Signal(object)
    compile_started = Signal()
    compile_finished = Signal(object)

    def __init__(self, name: str = "engine", parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.thread = QThread()
        self.thread.setObjectName(f"{name}-worker")
        self.worker = EngineWorker()
        self.worker.moveToThread(self.thread)
        self.load_requested.connect(self.worker.load)
        self.generate_requested.connect(self.worker.generate)
        self.unload_requested.connect(self.worker.unload)
        self.drop_draft_requested.connect(self.worker.drop_draft)
        self.probe_requested.connect(self.worker.probe)
        self.predict_requested.connect(self.worker.predict)
        self.score_requested.connect(self.worker.score)
        self.sweep_requested.connect(self.worker.sweep)
        self.speculate_requested.connect(self.worker.speculate)
        for name in ("devices_found", "models_found", "load_progressed", "loaded", "load_failed", "unloaded",
                     "generation_started", "prefilled", "tokens_generated", "generation_finished",
                     "generation_failed", "predicted", "scored", "sweep_stepped", "sweep_point", "sweep_finished",
                     "sweep_failed", "speculation_events", "speculation_finished", "speculation_failed",
                     "compile_started", "compile_finished"):
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

    def sweep(self, request, batches) -> None:
        """Run a batch-size sweep; :meth:`stop` ends it."""
        self._generation_cancel = CancelToken()
        self.sweep_requested.emit(request, list(batches), self._generation_cancel)

    def speculate(self, request, draft: str, draft_tokens: int, compare_plain: bool) -> None:
        """Speculative decoding (after plain decoding when ``compare_plain``); :meth:`stop` ends it."""
        self._generation_cancel = CancelToken()
        self.speculate_requested.emit(request, draft, draft_tokens, compare_plain, self._generation_cancel)

    def unload(self) -> None:
        self.unload_requested.emit()

    def shutdown(self, timeout_ms: int = 2000) -> bool:
        """Cancel whatever runs, end the thread; ``False`` if it did not end in time."""
        self.cancel_load()
        self.stop()
        self.thread.quit()
        if not self.thread.wait(timeout_ms):
            return False
        self.worker.release()  # the thread has ended: its models are freed here, not kept for the process's life
        return True
