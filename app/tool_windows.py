"""The windows the main window opens (Compare, Cost explorer, Batching and speculative decoding,
Traffic, Run history): made on first use, brought to the front after, closed with the main window."""

from __future__ import annotations

from PySide6.QtCore import QObject, Qt, Signal, Slot


class ToolWindows(QObject):
    """One of each window per main window; ``history_opened`` carries the history dialog once its
    records are in its table."""

    history_opened = Signal(object)

    def __init__(self, main) -> None:
        super().__init__(main)
        self.main = main
        self.compare = None
        self.costs = None
        self.speedups = None
        self.traffic = None

    def open_compare(self):
        """The Compare window, its lane 1 set to the model chosen in the main window (lane 2 the
        same model in nf4)."""
        from app.compare_window import CompareWindow  # lazy: a tool's window loads when it first opens
        from engine.measure.compare import LaneSpec  # lazy: a tool's window loads when it first opens

        if self.compare is None:
            self.compare = CompareWindow()
            self.compare.closed.connect(self._on_compare_closed)
            request = self.main.model_panel.request()
            self.compare.lanes[0].configure(LaneSpec(request.model, request.precision, request.device,
                                                     kv_dtype=request.kv_dtype))
            self.compare.lanes[1].configure(LaneSpec(request.model, "nf4", request.device))
        return _front(self.compare)

    @Slot()
    def _on_compare_closed(self) -> None:
        """Its lanes' models were freed on close; a later View → Compare starts afresh."""
        window, self.compare = self.compare, None
        if window is not None:
            window.deleteLater()

    def open_costs(self):
        """The Cost explorer, showing the model and precision chosen in the main window (it reads
        configs, measures this machine and scans the history off the GUI thread)."""
        from app.cost_window import CostWindow  # lazy: a tool's window loads when it first opens

        if self.costs is None:
            self.costs = CostWindow()
        request = self.main.model_panel.request()
        loaded = self.main.loaded
        runs = loaded is not None and self.main.model_panel.loaded_request == request
        self.costs.set_model(request.model, request.precision, loaded.kv_dtype if runs else None)
        self.costs.reload_history()
        return _front(self.costs)

    def open_history(self):
        """Every finished run (kept in the user data folder), reopened read-only."""
        from app.history_dialog import HistoryDialog  # lazy: a tool's window loads when it first opens

        dialog = HistoryDialog(self.main)
        dialog.setAttribute(Qt.WA_DeleteOnClose)
        dialog.ready.connect(lambda: self.history_opened.emit(dialog))
        dialog.open()
        return dialog

    def open_speedups(self):
        """Batching sweep and speculative decoding on the main window's loaded model."""
        from app.speedup_window import SpeedupWindow  # lazy: a tool's window loads when it first opens

        if self.speedups is None:
            self.speedups = SpeedupWindow(self.main.session, self.main.request_for_tool)
        self.speedups.set_model(self.main.loaded)
        self.speedups.set_loading(self.main.loading)
        return _front(self.speedups)

    def open_traffic(self):
        """The server's traffic, live (the Server panel starts and stops the server)."""
        from app.traffic_window import TrafficWindow  # lazy: a tool's window loads when it first opens

        if self.traffic is None:
            self.traffic = TrafficWindow(self.main.server_panel)
        return _front(self.traffic)

    def job_ended(self) -> None:
        """A sweep or speculative run joined the history: the cost explorer's dots follow."""
        if self.costs is not None:
            self.costs.reload_history()

    def set_loading(self, loading: bool) -> None:
        if self.speedups is not None:
            self.speedups.set_loading(loading)

    def close_all(self) -> None:
        for window in (self.compare, self.costs, self.speedups, self.traffic):
            if window is not None:
                window.close()


def _front(window):
    window.show()
    window.raise_()
    return window
