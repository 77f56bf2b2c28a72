"""The engine in its own thread: one long-lived worker object per model slot.

The worker is created without a parent and moved to a QThread (a parented object can't
be moved). The GUI asks through ``*_requested`` signals, which Qt queues into the
worker's thread; results come back as signals, queued into the GUI thread. Stopping is
a :class:`CancelToken` the GUI sets directly: it must not wait in a queue behind the
generation it is meant to stop.
"""

from __future__ import annotations

import threading
import time

from PySide6.QtCore import QObject, QThread, QTimer, Signal, Slot

from app.background import yield_to_the_gui
from engine.base.cancel import CancelToken
from engine.base.errors import EngineError
from engine.base.events import BatchStep, DraftVerified, Finished, LoadProgress, TokenGenerated
from engine.estimates.estimate import config_for, fits_beside_loaded, predict
from engine.jobs import JobContext, Tagged
from engine.models.devices import available_devices
from engine.models.loading import load_model
from engine.models.model import release_free_memory
from engine.models.sources import list_models
from engine.generation.service import Accepted, Rejected, RequestEvent, TrafficStep, failure
from engine.prompts import Failed, PromptDoor, PromptJob


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
    predicted = Signal(object, object)  # LoadRequest, MemoryPrediction | None
    job_started = Signal(int)  # job id
    job_events = Signal(int, object)  # job id, tuple of its events in order
    job_finished = Signal(int, object)  # job id, its result
    job_failed = Signal(int, object)  # job id, Exception
    compile_started = Signal()
    compile_finished = Signal(object)  # engine.generation.compiled_step.CompileReport (from the compile thread)

    def __init__(self) -> None:
        super().__init__()  # no parent: moveToThread needs a parentless object
        self._model = None
        self._kept: dict = {}  # what jobs keep between them (a speculative draft)
        self.door = PromptDoor()  # the window's prompts' way into the model's engine service

    @Slot()
    def yield_to_the_gui(self) -> None:
        """Lower this thread's scheduling priority below the GUI's (app/background.py)."""
        yield_to_the_gui()
        self.niced_thread = threading.get_native_id()

    @Slot()
    def probe(self) -> None:
        """Find devices and cached models here, so the GUI thread never imports torch."""
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
            from engine.generation.compiled_step import compile_in_background  # lazy: torch, on the model's thread

            compile_in_background(model.fast, self._compile_done)

    def _compile_done(self, report) -> None:
        """From the build's thread: the report, unless this worker is gone (the window closed
        while a build that ignored its stop was ending: nobody is left to tell)."""
        try:
            self.compile_finished.emit(report)
        except RuntimeError:  # "Signal source has been deleted"
            pass

    @Slot(object)
    def predict(self, request) -> None:
        """Memory this load would need (from the config on disk), before loading anything."""
        try:
            config = config_for(request.model)
            prediction = None if config is None else predict(config, request.precision, request.device)
        except Exception:  # a prediction is advice: never let it block a load
            prediction = None
        self.predicted.emit(request, prediction)

    @Slot()
    def drop_draft(self) -> None:
        """Free the speculative draft (its window closed); the model stays."""
        self._drop_draft()

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
        self._kept.clear()  # the model's engine service (its caches, its prefix cache) goes with it
        if self._model is not None:
            model, self._model = self._model, None
            if model.fast is not None:
                from engine.generation.compiled_step import stop_compiling  # lazy: torch, on the model's thread

                stop_compiling(model.fast, timeout=0)  # its build process is killed within a fraction of a second
            model.close()

    def _drop_draft(self) -> None:
        draft = self._kept.pop("draft", None)
        if draft is not None:
            draft.close()

    @Slot(int, object, object)
    def run_job(self, job_id: int, job, cancel: CancelToken) -> None:
        """Run one job of engine/jobs.py: its events cross to the GUI thread in batches, its
        result (or its error) once at the end."""
        if self._model is None:
            self.job_failed.emit(job_id, EngineError("No model is loaded: load one first."))
            return
        self.job_started.emit(job_id)
        pending: list = []
        sent = [time.perf_counter()]

        def flush() -> None:
            if pending:
                self.job_events.emit(job_id, tuple(pending))
                pending.clear()
            sent[0] = time.perf_counter()

        def emit(event) -> None:
            pending.append(event)
            # streams of tokens and steps go in batches; a rarer event (the prompt read, a point
            # measured) goes at once
            if not _streamed(event) or time.perf_counter() - sent[0] >= BATCH_S:
                flush()

        try:
            result = job.run(JobContext(self._model, cancel, emit, self._kept, self.door))
        except Exception as exc:  # errors cross the thread as data
            flush()
            self.job_failed.emit(job_id, exc)
            return
        flush()
        self.job_finished.emit(job_id, result)


def _streamed(event) -> bool:
    """Tokens and batch steps: many a second, so they travel in batches (a served request's
    tokens and the server's steps too, but the step that leaves its core empty goes at once:
    nothing may follow it for a while)."""
    if isinstance(event, TrafficStep):
        return bool(event.requests)
    inner = event.event if isinstance(event, (Tagged, RequestEvent)) else event
    return isinstance(inner, (TokenGenerated, BatchStep, DraftVerified))


class ModelSession(QObject):
    """The GUI's handle on one model's worker thread: load, unload, and a queue of jobs.

    Windows :meth:`submit` jobs (engine/jobs.py) and :meth:`ask` prompts (engine/prompts.py), and
    get an id; jobs run one at a time in the order submitted, and the session says which runs and which wait (``queue_changed``), so a
    window never has to keep another out of the engine: a job submitted while another runs
    waits, visibly. ``job_started / job_events / job_finished / job_failed`` carry the id; a
    window listens for its own ids.

    It lives in the GUI thread and re-emits the worker's signals as its own, so whatever
    connects to a session (widgets, tests) runs in the GUI thread, even a plain function.
    """

    load_requested = Signal(object, object)
    job_requested = Signal(int, object, object)
    unload_requested = Signal()
    drop_draft_requested = Signal()
    probe_requested = Signal()
    predict_requested = Signal(object)

    devices_found = Signal(object)
    models_found = Signal(object)
    load_progressed = Signal(object)
    loaded = Signal(object)
    load_failed = Signal(object)
    unloaded = Signal()
    predicted = Signal(object, object)
    job_started = Signal(int)
    job_events = Signal(int, object)
    job_finished = Signal(int, object)
    job_failed = Signal(int, object)
    queue_changed = Signal()
    compile_started = Signal()
    compile_finished = Signal(object)

    def __init__(self, name: str = "engine", parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.thread = QThread()
        self.thread.setObjectName(f"{name}-worker")
        self.worker = EngineWorker()
        self.worker.moveToThread(self.thread)
        self.load_requested.connect(self.worker.load)
        self.job_requested.connect(self.worker.run_job)
        self.unload_requested.connect(self.worker.unload)
        self.drop_draft_requested.connect(self.worker.drop_draft)
        self.probe_requested.connect(self.worker.probe)
        self.predict_requested.connect(self.worker.predict)
        for name in ("devices_found", "models_found", "load_progressed", "loaded", "load_failed", "unloaded",
                     "predicted", "compile_started", "compile_finished"):
            # signal to signal, across threads: queued into this (the GUI) thread
            getattr(self.worker, name).connect(getattr(self, name))
        self.worker.job_started.connect(self._on_started)
        self.worker.job_events.connect(self._on_worker_events)
        # bound slots of this object, not lambdas: PySide runs a lambda in the emitting (worker)
        # thread, and the queue's bookkeeping and the re-emitted signals belong to the GUI thread
        self.worker.job_finished.connect(self._on_worker_finished)
        self.worker.job_failed.connect(self._on_worker_failed)
        self.thread.finished.connect(self.worker.deleteLater)
        self.thread.started.connect(self.worker.yield_to_the_gui)  # in the new thread, before any torch work
        self._load_cancel: CancelToken | None = None
        self._next_job = 1
        self.jobs: dict[int, tuple[object, CancelToken]] = {}
        """Jobs not yet ended: id → (job, its cancel token)."""
        self.running: int | None = None
        """The id of the job running now."""
        self.door = self.worker.door
        """The model's door for the window's prompts (engine/prompts.py)."""
        self._asked: dict[object, tuple[int, CancelToken, list]] = {}
        """Prompts asked at the door: their tag → (their id, cancel token, events not yet sent)."""
        self._ended: dict[int, tuple[Signal, object]] = {}
        """Asked prompts' ends heard while their own job runs: said once it has ended."""
        self._served: set = set()
        """Tags of asked prompts that went straight into a running server."""
        self.thread.start()

    # -- jobs ------------------------------------------------------------------------
    def submit(self, job) -> int:
        """Queue ``job``; returns its id. It starts when the jobs before it have ended."""
        job_id, self._next_job = self._next_job, self._next_job + 1
        cancel = CancelToken()
        self.jobs[job_id] = (job, cancel)
        self.job_requested.emit(job_id, job, cancel)
        self.queue_changed.emit()
        return job_id

    def ask(self, request) -> int:
        """``request`` answered by this model's engine service (engine/prompts.py): while a server
        runs, beside the HTTP clients' requests; otherwise by a :class:`PromptJob` of its own
        queued behind the jobs before it, whose id it takes, so it waits, starts and ends as any
        job does. The same service, tokenizer, queue and error shape either way. Returns an id
        the ``job_*`` signals carry, as :meth:`submit` does."""
        cancel = CancelToken()
        try:
            prompt, waits = self.door.ask(request, cancel)
        except EngineError as exc:  # the server's queue is full: said as a failure once the caller holds the id
            job_id, self._next_job, error = self._next_job, self._next_job + 1, exc
            QTimer.singleShot(0, self, lambda: self.job_failed.emit(job_id, error))
            return job_id
        if waits:
            job_id = self.submit(PromptJob(prompt))
        else:
            job_id, self._next_job = self._next_job, self._next_job + 1
            self._served.add(prompt.tag)
        self._asked[prompt.tag] = (job_id, cancel, [])
        return job_id

    def cancel(self, job_id: int | None) -> None:
        """Stop a job (running: at its next token; waiting: it ends as soon as it starts), or an
        asked prompt (at its next step)."""
        if job_id in self.jobs:
            self.jobs[job_id][1].cancel()
        for asked, cancel, _ in self._asked.values():
            if asked == job_id:
                cancel.cancel()

    @Slot(int, object)
    def _on_worker_events(self, job_id: int, events: tuple) -> None:
        """A job's events on to its listeners, but an asked prompt's go to its own id (they travel
        tagged among the events of the job that steps the service: a server, a PromptJob)."""
        if not self._asked:
            self.job_events.emit(job_id, events)
            return
        rest = []
        for event in events:
            if isinstance(event, Tagged) and event.tag in self._asked:
                self._answer(event.tag, event.event)
            else:
                rest.append(event)
        for tag, (asked, _, pending) in list(self._asked.items()):
            if pending:
                self.job_events.emit(asked, tuple(pending))
                pending.clear()
        if rest:
            self.job_events.emit(job_id, tuple(rest))

    def _answer(self, tag, event) -> None:
        asked, _, pending = self._asked[tag]
        if isinstance(event, Accepted):
            return
        if not isinstance(event, (Rejected, Failed, Finished)):
            pending.append(event)
            return
        del self._asked[tag]
        self._served.discard(tag)
        if pending:
            self.job_events.emit(asked, tuple(pending))
        error = event.error if isinstance(event, Failed) else failure(event)  # as generate() raises it
        ended = (self.job_finished, event) if error is None else (self.job_failed, error)
        if asked in self.jobs:  # its own job still runs: said once that has ended, as any job's end is
            self._ended[asked] = ended
        else:
            ended[0].emit(asked, ended[1])

    def waiting(self) -> list[int]:
        """Ids of the jobs waiting for the running one, in order."""
        return [job_id for job_id in self.jobs if job_id != self.running]

    @property
    def busy(self) -> bool:
        """A job runs or waits."""
        return bool(self.jobs)

    def describe(self, job_id: int | None) -> str:
        return type(self.jobs[job_id][0]).kind if job_id in self.jobs else ""

    def _on_started(self, job_id: int) -> None:
        self.running = job_id
        self.queue_changed.emit()
        self.job_started.emit(job_id)

    @Slot(int, object)
    def _on_worker_finished(self, job_id: int, result) -> None:
        self._on_ended(job_id, self.job_finished, result)

    @Slot(int, object)
    def _on_worker_failed(self, job_id: int, exc) -> None:
        self._on_ended(job_id, self.job_failed, exc)

    def _on_ended(self, job_id: int, signal, payload) -> None:
        job, _ = self.jobs.pop(job_id, (None, None))
        if self.running == job_id:
            self.running = None
        error = payload if signal is self.job_failed else None
        if isinstance(job, PromptJob):  # its prompt's end is said, not the job's
            tag = job.prompt.tag
            if tag in self._asked:  # the job ended before its prompt did: it could not run, or broke first
                del self._asked[tag]
                self.door.drop(tag)
                self.job_failed.emit(job_id, error or EngineError("The engine stopped before this answer finished."))
            elif job_id in self._ended:
                signal, payload = self._ended.pop(job_id)
                signal.emit(job_id, payload)
        else:
            signal.emit(job_id, payload)
            if getattr(job, "kind", "") == "serving":
                self._server_ended(error)
        self.queue_changed.emit()

    def _server_ended(self, error: Exception | None) -> None:
        """The prompts that went into the server and got no end (it broke, or stopped without
        draining them) fail: nothing will answer them any more."""
        for tag in list(self._served):
            if tag in self._asked:
                asked = self._asked.pop(tag)[0]
                self.job_failed.emit(asked, error or EngineError("The server stopped before this answer finished."))
        self._served.clear()

    # -- the model -------------------------------------------------------------------
    def load(self, request) -> None:
        self._load_cancel = CancelToken()
        self.load_requested.emit(request, self._load_cancel)

    def cancel_load(self) -> None:
        if self._load_cancel is not None:
            self._load_cancel.cancel()

    def unload(self) -> None:
        self.unload_requested.emit()

    def shutdown(self, timeout_ms: int = 2000) -> bool:
        """Cancel whatever runs or waits, end the thread; ``False`` if it did not end in time."""
        self.cancel_load()
        for _, cancel in self.jobs.values():
            cancel.cancel()
        for _, cancel, _ in self._asked.values():
            cancel.cancel()
        self.thread.quit()
        if not self.thread.wait(timeout_ms):
            return False
        self.worker.release()  # the thread has ended: its models are freed here, not kept for the process's life
        return True
