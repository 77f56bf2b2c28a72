"""The serving simulator's prediction beside each setting the load generator measures (``load --predict``).

Against this workbench's server: its ``/v1/models`` lists the engine's limits (batch, token
budget, prompt chunk, KV blocks, prefix caching), the served model is loaded here at the same
precision, its steps are timed once on this machine (engine/estimates/step_cost.py, kept for the
next time) and the prompts tokenized as the server reads them. Each setting is then simulated with
the generator's own order and arrivals (the same seed), and the simulator keeps its prefix cache
from one setting to the next as the server does, starting empty: a server that answered other
requests before holds more in its cache than the prediction assumes.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from engine.base.errors import EngineError, InvalidRequestError
from engine.base.memory import default_kv_budget
from engine.base.request import GenerationRequest
from engine.endpoint.scrape import metrics_url
from engine.estimates.simulator import (EngineLimits, ServingSimulator, Simulated, Workload, closed_loop, open_loop,
                                       recorded)
from engine.estimates.step_cost import FrontEnd, served_work
from engine.load.generator import LoadPlan, LoadRunner, listed_model, setting_label
from engine.load.metrics import Summary
from engine.load.report import ttft_split

if TYPE_CHECKING:
    from engine.estimates.step_cost import StepCost
    from engine.load.generator import SettingResult
    from engine.load.prompts import Prompt


@dataclass
class Predictor:
    simulator: ServingSimulator
    """Its step cost (``simulator.cost``) is the server's: the engine's steps and its front end."""
    prompt_ids: list[list[int] | None]

    def predict(self, plan: "LoadPlan", result: "SettingResult") -> Simulated:
        """``result``'s setting simulated: the generator's order and arrivals, each answer as long as
        ``max_tokens`` (``ignore_eos``) or as the server's answer to that request was."""
        return self.simulator.run(self.workload(plan, result), plan.slo, plan.max_duration_s)

    def workload(self, plan: "LoadPlan", result: "SettingResult") -> Workload:
        """``result``'s setting as the simulator's workload: request j is the generator's j (the
        same shuffle)."""
        lengths = None
        if not plan.ignore_eos:
            lengths = [r.output_tokens if r.ok and r.output_tokens else plan.max_tokens for r in result.results]
        return self.setting_workload(plan, result.mode, result.value, lengths)

    def predict_setting(self, plan: "LoadPlan", mode: str, value: float, lengths: list[int] | None = None) -> Simulated:
        """A setting of ``plan`` (``concurrency`` or ``rate``) simulated before it runs, each answer
        ``max_tokens`` long (``lengths``: each request's own)."""
        return self.simulator.run(self.setting_workload(plan, mode, value, lengths), plan.slo, plan.max_duration_s)

    def setting_workload(self, plan: "LoadPlan", mode: str, value: float,
                         lengths: list[int] | None = None) -> Workload:
        if mode == "concurrency":
            workload = closed_loop(int(value), self.prompt_ids, [plan.max_tokens], plan.requests, plan.seed)
        else:
            workload = open_loop(value, self.prompt_ids, [plan.max_tokens], plan.requests, plan.seed, plan.burstiness)
        if lengths is not None:
            workload = replace(workload, requests=tuple(replace(r, output_tokens=n)
                                                        for r, n in zip(workload.requests, lengths)))
        return workload


def server_meta(url: str, api_key: str | None, model: str | None) -> tuple[dict, str | None]:
    """What the server at ``url`` lists of ``model`` (the first it lists when ``None``): its
    ``meta`` and its name."""
    import httpx  # lazy: only a prediction reads it here

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        listed = httpx.get(url.rstrip("/") + "/models", headers=headers, timeout=10).json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise InvalidRequestError(f"Can't read {url}/models to predict its load: {exc}") from None
    served, meta = listed_model(listed, model)
    return meta, served


FRONT_END_SEED = 7919
"""The front end's calibration load draws its order apart from the loads it predicts."""
ONE_STEP_FEWEST = 4
"""The fewest requests whose prompt took one step that the front end's latencies are read from
(fewer: every request's)."""


def fit_front_end(url: str, api_key: str | None, model: str | None, prompts: list["Prompt"],
                  ids: list[list[int]], simulator: ServingSimulator, endpoint: str = "chat") -> "StepCost":
    """What the server's front end adds around the engine's steps, fitted to short loads of its own
    against it (after a few requests to warm it up: closed loops of 1 user and of as many as its
    batch holds, up to 32, then an open loop at half the full batch's request rate; 32-token
    answers). Each part is read where it holds steadiest:

    - the engine's clock: one user's TPOT gap to what the engine's steps alone predict is a step's
      and a token's share, the full batch's adds the other rows' tokens;
    - each request's latency outside the engine at one user: its TTFT gap, less those shares,
      kept one a request (their spread is part of what a client sees), read from the requests
      whose prompt took one step (what the prefix cache left of it fits one chunk): over a prompt
      read in several steps the gap is mostly the step model's error, which dealt to another
      request would move its TTFT by as much;
    - how many tokens each prompt's first text comes with (the server's running usage says;
      :meth:`ServingSimulator.learn_first_text`), learned before each load is simulated;
    - the client's part of the TTFT (``FrontEnd.client_s``): the clients' mean TTFT less the
      server's own from arrival (its ``/metrics`` histogram) and less the steps the first texts
      were held back for, at each of the three loads: measured on both sides, so free of the step
      model's error, and it grows with what is in flight.

    ``simulator`` runs the same loads, so its prefix cache stays the server's. The server's own
    steps, as its ``/metrics`` sums their seconds, are checked against the timed figures meanwhile
    (:func:`served_speed`, said in the front end's source). Returns the simulator's step cost with
    the front end in it."""
    most = max(1, min(simulator.limits.max_batch, 32))
    simulator.cost = replace(simulator.cost, front=None)

    def load(requests: int, seed: int, users: int = 0, rate: float = 0.0, fitted: bool = True):
        plan = LoadPlan(url=url, model=model, api_key=api_key, concurrency=(users,) if users else (),
                        rates=(rate,) if rate else (), requests=requests, max_tokens=32, ignore_eos=True,
                        endpoint=endpoint, seed=seed, max_duration_s=120.0).validated()
        before = served_steps(url, api_key)
        (setting,) = LoadRunner(plan, prompts).run()  # (its /metrics read meanwhile, as a measured load's is)
        after = served_steps(url, api_key)
        predictor = Predictor(simulator, ids)
        simulator.learn_first_text(predictor.workload(plan, setting), setting.results)  # each prompt's first text
        predicted = predictor.predict(plan, setting)
        measured, alone = setting.summary, predicted.summary
        if fitted and not (measured.tpot and alone.tpot and measured.ttft and alone.ttft):
            raise InvalidRequestError(f"The front end's calibration load got no answers from {url}.")
        gap = (measured.tpot or {}).get("median", 0.0) - (alone.tpot or {}).get("median", 0.0)
        return setting, predicted, gap, steps_between(before, after), client_part(setting, predicted)

    load(4, FRONT_END_SEED, users=1, fitted=False)  # the warm-up (simulated too: the prefix cache stays the server's)
    one, one_predicted, one_gap, one_served, one_client = load(24, FRONT_END_SEED + 1, users=1)
    served, clients = [one_served], [one_client]
    token, loads = 0.0, "1 user"
    if most > 1:
        loads = f"1 and {most} users"
        full, _, full_gap, full_served, full_client = load(3 * most, FRONT_END_SEED + most, users=most)
        served.append(full_served)
        token = max(0.0, (full_gap - one_gap) / (most - 1))
        rate = full.summary.request_throughput / 2
        if rate > 0:
            clients += [full_client, load(24, FRONT_END_SEED + 2 * most, rate=rate)[4]]
            loads = f"1 and {most} users and {rate:.3g} requests/s"
    step = max(0.0, one_gap - token)
    # request by request: the generator's request j is the simulator's j
    gaps = [(m.ttft_s - p.ttft_s, steps) for m, p, steps in
            zip(one.results, one_predicted.results, one_predicted.prompt_steps)
            if m.ok and p.ok and m.ttft_s is not None and p.ttft_s is not None]
    one_step = [gap for gap, steps in gaps if steps == 1]
    first = one_step if len(one_step) >= ONE_STEP_FEWEST else [gap for gap, _ in gaps]
    spread = tuple(gap - step - token for gap in first)
    request = max(0.0, statistics.median(spread)) if spread else 0.0
    source = f"fitted to loads of {loads} against the server"
    speeds = [served_speed(simulator.cost, counted) for counted in served]
    if all(speed is not None for speed in speeds):  # checked, not applied: see served_speed
        took = " and ×".join(f"{speed:.2f}" for speed in speeds)
        source += f", whose own steps took ×{took} the timed figures"
    client = tuple(sorted(clients)) if None not in clients else ()
    front = FrontEnd(step, token, request, source, spread, client)
    cost = replace(simulator.cost, front=front)
    simulator.cost = cost
    return cost


def client_part(setting: "SettingResult", predicted: Simulated) -> tuple[float, float] | None:
    """A load's (requests in flight when one arrived, on average in its simulation; the clients'
    mean TTFT less the server's own, from its /metrics, less the steps the first texts were held
    back for as ``predicted`` has them), ``None`` without the server's figure."""
    split = ttft_split(setting, predicted)
    if split is None or not predicted.in_flight:
        return None
    return statistics.fmean(predicted.in_flight), max(0.0, split.client_s - split.predicted_client_s)


def served_speed(cost: "StepCost", served: tuple[float, tuple[float, ...]] | None) -> float | None:
    """The seconds the server's own steps took (``served``: their seconds and parts, as its
    ``/metrics`` summed them over a load) over what ``cost`` gives the same steps: the step model
    checked on the steps served (``None`` where the server doesn't count them). Said beside a
    prediction, not applied to it: a load of many users makes the engine's steps slower by the
    cores its client's streams take, which the front end's share per streamed token stands for,
    and on a shared machine the figure moves from one load to the next by as much as it is off."""
    if served is None or served[0] <= 0 or cost.total(served[1]) <= 0:
        return None
    return served[0] / cost.total(served[1])


def steps_between(before, after) -> tuple[float, tuple[float, ...]] | None:
    """The steps a server ran between two readings of :func:`served_steps` (``None``: uncounted)."""
    if before is None or after is None:
        return None
    return after[0] - before[0], tuple(a - b for a, b in zip(after[1], before[1]))


def served_steps(url: str, api_key: str | None) -> tuple[float, tuple[float, ...]] | None:
    """The server's steps so far as its ``/metrics`` counts them (``served_work``); ``None`` where
    it doesn't."""
    import httpx  # lazy: only a prediction reads it here

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        answer = httpx.get(metrics_url(url), headers=headers, timeout=10)
        return served_work(answer.text) if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def engine_of(meta: dict) -> EngineLimits:
    """The simulator's limits from what this workbench's server lists (``meta['engine']``)."""
    engine = meta.get("engine")
    if not isinstance(engine, dict):
        raise InvalidRequestError("A prediction needs this workbench's server: its /v1/models lists the engine's "
                                  "limits, and this server's doesn't.")
    try:
        return EngineLimits(int(engine["max_batch"]), int(engine["token_budget"]), int(engine["prefill_chunk"]),
                            None if engine["kv_blocks"] is None else int(engine["kv_blocks"]),
                            bool(engine["prefix_caching"]), bool(engine["chunked_prefill"]),
                            int(engine["block_tokens"]))
    except (KeyError, TypeError, ValueError):
        raise InvalidRequestError("The server's /v1/models lists its engine's limits in a shape this version "
                                  "doesn't read.") from None


def predictor_for(meta: dict, model, prompts: list["Prompt"], endpoint: str, progress=print,
                  url: str | None = None, api_key: str | None = None, served: str | None = None,
                  cancelled=lambda: False, kv_budget_bytes: int | None = None) -> Predictor:
    """A predictor for the server ``meta`` describes (its ``/v1/models`` entry's ``meta``), with
    ``model`` (a reference this machine can load, ``default``, a folder…, or the ``LoadRequest``
    the server's model was loaded with) standing for the served one: loaded here at the server's
    precision and KV dtype, its steps timed once (kept for the next time), then let go; with the
    server's ``url``, its front end fitted too (:func:`fit_front_end`). ``cancelled`` is asked
    between the stages (a stopped load). ``kv_budget_bytes``: another KV budget than the server's."""
    from engine.estimates.step_cost import calibrate, key_for, remember, remembered  # lazy: the engine (torch)
    from engine.generation.core import CoreSettings  # lazy: the engine (torch)
    from engine.models.loading import LoadRequest, load_model  # lazy: the engine (torch)
    from engine.models.precision import KV_DTYPES  # lazy: the engine (torch)

    limits = engine_of(meta)
    engine = meta["engine"]
    if str(meta.get("device", "cpu")).split(":")[0] != "cpu":
        raise InvalidRequestError(f"The prediction times the server's steps on this machine's CPU, and this server "
                                  f"runs on {meta.get('device_name') or meta.get('device')}: no prediction for it.")
    if engine.get("batch_invariant") or engine.get("lookahead"):
        raise InvalidRequestError("The prediction models plain steps; this server runs batch-invariant arithmetic or "
                                  "speculative decoding, which it doesn't model.")
    precision = str(meta.get("precision") or "")
    base = model if isinstance(model, LoadRequest) else LoadRequest(str(model))
    name = base.model
    progress(f"predict  loading {name} in {precision} here to time its steps …")
    loaded = load_model(replace(base, precision=precision, device="cpu"))
    try:
        if meta.get("n_params") not in (None, loaded.info.parameters):
            raise InvalidRequestError(f"The server runs a model of {meta['n_params']:,} parameters and {name} has "
                                      f"{loaded.info.parameters:,}: name the served model (--predict-model).")
        served_kv = engine.get("kv_dtype")
        if served_kv and served_kv != loaded.info.kv_dtype:  # the server keeps its cache in another dtype: so do we
            option = next((k for k, dtype in KV_DTYPES.items() if dtype == served_kv), None)
            if option is None:
                raise InvalidRequestError(f"The server's KV cache keeps {served_kv}, which this machine can't load.")
            loaded.close()
            loaded = load_model(replace(base, precision=precision, device="cpu", kv_dtype=option))
        if loaded.fast is not None:
            from engine.generation.compiled_step import compile_decoder  # lazy: torch's compiler

            compile_decoder(loaded.fast)  # the server runs its compiled steps once they are ready
        per_token = loaded.info.kv_bytes_per_token or 1
        if kv_budget_bytes is not None:
            limits = replace(limits, kv_blocks=kv_budget_bytes // (per_token * limits.block_tokens))
        settings = CoreSettings(token_budget=limits.token_budget, max_batch=limits.max_batch,
                                prefill_chunk=limits.prefill_chunk, chunked_prefill=limits.chunked_prefill,
                                prefix_caching=limits.prefix_caching, block_tokens=limits.block_tokens,
                                kv_budget_bytes=None if limits.kv_blocks is None else
                                limits.kv_blocks * limits.block_tokens * per_token)
        key = key_for(loaded, settings)
        cost = remembered(key)
        if cost is None and not cancelled():
            progress("predict  timing the engine's steps on this machine (about 30 s, kept for the next time) …")
            cost = calibrate(loaded, settings, 30.0)
            remember(key, cost)
        mode = "chat" if endpoint == "chat" else "raw"
        ids = _tokenized(loaded, prompts, mode) if prompts else []
    finally:
        loaded.close()  # the steps are timed and the prompts read: the copy goes
    if cancelled():
        raise InvalidRequestError("Stopped before the prediction was ready.")
    progress(f"predict  {cost.describe()}")
    simulator = ServingSimulator(limits, cost)
    if url is not None:  # (fitted each time: it depends on where the server runs and what runs beside it)
        progress("predict  fitting the server's front end to a short load of 1 user and a full batch …")
        cost = fit_front_end(url, api_key, served, prompts, ids, simulator, endpoint)
        progress(f"predict  {cost.front.describe()}")
    return Predictor(simulator, ids)


def _tokenized(loaded, prompts: list["Prompt"], mode: str) -> list[list[int] | None]:
    """Each prompt's ids as the server reads it (``None``: one the model can't take, which the
    server refuses)."""
    ids: list[list[int] | None] = []
    for prompt in prompts:
        try:
            ids.append(loaded.encode(GenerationRequest(prompt.text, mode=mode)))
        except EngineError:
            ids.append(None)
    if all(i is None for i in ids):
        raise InvalidRequestError("The model can't take any of these prompts: nothing to predict.")
    return ids


def replay(report: dict, model="default", changes: dict | None = None, precision: str | None = None,
           kv_budget_bytes: int | None = None, progress=print) -> list[tuple[str, "Simulated", Summary]]:
    """Each setting of a load generator's report (``load --json``) through the serving simulator:
    its requests as they were sent (:func:`~engine.estimates.simulator.recorded`), the engine's
    limits those of the server that served them (its ``/v1/models``, kept in the report; this
    workbench's serve defaults for another server) with ``changes`` made to them (``max_batch``,
    ``token_budget``, ``prefix_caching``…) and ``kv_budget_bytes`` for its KV budget, each step
    timed on this machine with ``model`` standing for the served one at ``precision`` (the
    server's by default). No server runs, so no front end is added: the engine's steps alone.
    Returns (setting label, simulated, recorded summary) per setting."""
    from engine.generation.core import CoreSettings  # lazy: the engine (torch)
    from engine.serve.server import ServeSettings  # lazy: the server's defaults, for another server's report

    try:
        settings = list(report["settings"])
        max_tokens = int(report["plan"]["max_tokens"])
        endpoint = str(report["plan"].get("endpoint") or "chat")
    except (KeyError, TypeError, ValueError):
        raise InvalidRequestError("Not a load generator's report: it has no plan and settings (write one with "
                                  "load --json).") from None
    if not settings:
        raise InvalidRequestError("The report holds no setting to replay.")
    meta = dict(next((s["runs_on"] for s in settings if isinstance(s.get("runs_on"), dict) and s["runs_on"]), {}))
    if not isinstance(meta.get("engine"), dict):  # another server: this workbench's serve defaults
        served = ServeSettings()  # its core as the server makes it (engine/serve/server.py)
        meta["engine"] = asdict(EngineLimits.of(CoreSettings(token_budget=served.token_budget,
                                                             max_batch=served.max_batch,
                                                             prefix_caching=served.prefix_caching), None))
        if kv_budget_bytes is None:
            kv_budget_bytes = default_kv_budget("cpu")
        meta.pop("n_params", None)  # its model stands for another server's: no parameter count to compare
        meta["device"] = "cpu"
    meta["engine"] = {**meta["engine"], **(changes or {})}
    if precision:
        meta["precision"] = precision
    meta.setdefault("precision", "fp32")
    predictor = predictor_for(meta, model, [], endpoint, progress=progress, kv_budget_bytes=kv_budget_bytes)
    out = []
    for setting in settings:
        workload = recorded(setting, max_tokens)
        run = predictor.simulator.run(workload)
        try:
            label = setting_label(setting["mode"], float(setting["value"]))
            recorded_summary = Summary(**setting["summary"])
        except (KeyError, TypeError, ValueError):
            raise InvalidRequestError("A setting of the report has no summary in this version's shape: record the "
                                      "load again (load --json).") from None
        out.append((label, run, recorded_summary))
    return out

