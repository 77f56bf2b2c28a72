"""The serving simulator's predictions against the server itself, side by side in one run.

For each precision: ``inference-workbench serve`` on the default model in a subprocess (its
defaults: batch 16, token budget 128, prefix caching on) on all CPUs but one, the load generator
on that one (``--shared-cores``: both on all), its compiled steps ready; the step-cost
model calibrated in this process on the same model and limits (engine/estimates/step_cost.py
``calibrate``, a short sweep of its own, never the runs it is checked against); then the load
generator (engine/load) sends each setting and the simulator (engine/estimates/simulator.py)
predicts the same setting from the same plan (the same seed: the same order and arrivals) and
the prompts' token ids:

- two workloads: the shipped short questions with 64-token answers, and the shipped long
  documents with 32-token answers;
- closed loops of 1, 4 and 16 users, then Poisson rates at about 30%, 60% and 90% of the
  saturation throughput measured at 16 users;
- ``--shared-prefix``: every prompt behind one long shared preamble (prefix caching on);
- ``--small-kv``: a KV budget that holds a few requests' worst case, so the server preempts;
  preemptions counted from its ``/metrics`` against the simulator's.

Each setting is measured twice in a row (``--repeat``), each run predicted as it went (the second
may find more prompts cached); how far a setting's errors move from one run to the next is the
noise the targets are read against. Targets: p50 and p90 TTFT and TPOT within 15% of the
load generator's, throughput within 10%, preemptions within ±20%; simulating 10,000 requests under
5 s. Prints the CPU flags, the step-cost model, every row and its errors, and in each row
``steps ×``: the seconds the server's own steps took in that setting (as its ``/metrics`` sums
them) over what the prediction's step cost gives the same steps. Near 1, the step model held there
and an error is the schedule's or the front end's; above 1 at many users, the server's streaming
took time from its engine's cores (the front end's share per streamed token stands for that);
apart from those, the machine itself ran faster or slower than when its speed was fitted. And
``TTFT mean``: the mean TTFT split where the server's clock starts, each part measured / predicted:
the server's own (its ``/metrics`` histogram, from each request's arrival at it) and the client's
part (the rest: the HTTP side's wait for a core, the network). A step model off shows in the first,
a front end off in the second.

    python benchmarks/contention.py   # first, if another program may be running
    python benchmarks/simulator.py [--precisions bf16-fast,int8-fast] [--requests 48] [--repeat 2]
                                   [--shared-prefix] [--small-kv] [--shared-cores]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.preemption import cpu_flags  # noqa: E402
from benchmarks.serve import free_port, start_server, stop, wait_healthy  # noqa: E402
from benchmarks.serve_agreement import scrape  # noqa: E402

PREAMBLE = ("You are a careful assistant for a company's internal documentation. Answer briefly, in plain "
            "words, and say when you are not sure. ") * 12


def ready_when_compiled(server, timeout: float = 900.0) -> None:
    """Wait for the server's line saying its compiled steps are ready (its stderr)."""
    done = threading.Event()

    def read() -> None:
        for line in server.stderr:
            if b"Fast path:" in line and b"background" not in line:
                done.set()
    threading.Thread(target=read, daemon=True).start()
    if not done.wait(timeout):
        raise SystemExit("the server's compiled steps were not ready in time")


def token_ids(loaded, prompts) -> list[list[int]]:
    """Each prompt's token ids as the server reads it (its chat template around a user message)."""
    from engine.base.request import GenerationRequest

    return [loaded.encode(GenerationRequest(p.text)) for p in prompts]


def run_plan(url: str, prompts, plan_args: dict):
    from engine.load.generator import LoadPlan, LoadRunner

    plan = LoadPlan(url=url, ignore_eos=True, max_duration_s=600, **plan_args).validated()
    (setting,) = LoadRunner(plan, prompts).run()
    return plan, setting


def predict(plan, ids: list[list[int]], simulator):
    """The simulator's figures for ``plan``'s one setting, as ``load --predict`` gives them: the
    same order and arrivals, each prompt's own ids (so what the server found in its prefix cache
    is found here too: the simulator runs the settings in the server's order and keeps its cache
    between them)."""
    from engine.estimates.predict_load import Predictor

    (setting,) = plan.settings()
    return Predictor(simulator, ids).predict_setting(plan, *setting)


def speed() -> float:
    """Seconds to simulate 10,000 requests (Poisson at 20/s, prompts of 50-600 tokens, answers of 32
    and 128, batch 16, a 2,048-block KV cache)."""
    import time

    from engine.estimates.simulator import EngineLimits, open_loop, simulate
    from engine.estimates.step_cost import StepCost

    workload = open_loop(20.0, [50, 200, 600], [32, 128], requests=10_000, seed=1)
    started = time.perf_counter()
    simulate(workload, EngineLimits(max_batch=16, token_budget=256, prefill_chunk=256, kv_blocks=2048),
             StepCost(0.001, 0.02, 0.002, 1e-7, 0.001, 0.0002, 0.0))
    return time.perf_counter() - started


def split_cpus(shared: bool) -> tuple[list[int], list[int]]:
    """The server's CPUs and the load generator's. On few cores, a load generator that shares
    them takes turns with the server's matmul threads: each barrier of a step then waits for a
    thread the generator displaced, and both what is measured and what is predicted hang on the
    operating system's scheduler. So by default the generator (and this process, which also times
    the steps and simulates) keeps one core of its own."""
    cpus = sorted(os.sched_getaffinity(0))
    if shared or len(cpus) < 2:
        return cpus, cpus
    return cpus[:-1], cpus[-1:]


def error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precisions", default="bf16-fast,int8-fast")
    parser.add_argument("--requests", type=int, default=48,
                        help="requests per setting (16 users: at least 48); a p90 of 24 hangs on its three slowest")
    parser.add_argument("--calibrate-seconds", type=float, default=30.0)
    parser.add_argument("--shared-prefix", action="store_true", help="every prompt behind one shared preamble")
    parser.add_argument("--small-kv", action="store_true", help="a KV budget small enough to preempt")
    parser.add_argument("--repeat", type=int, default=2,
                        help="measure each setting this many times in a row, each run predicted as it went: "
                             "how far its errors move is the noise")
    parser.add_argument("--shared-cores", action="store_true",
                        help="the server and the load generator on every core (default: the load generator on one "
                             "core of its own, the server on the others, with as many threads)")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    server_cpus, client_cpus = split_cpus(args.shared_cores)
    os.environ["INFERENCE_WORKBENCH_THREADS"] = str(len(server_cpus))
    os.sched_setaffinity(0, server_cpus)  # before PyTorch starts: its threads on the server's CPUs

    from engine.estimates.predict_load import fit_front_end
    from engine.estimates.simulator import EngineLimits, ServingSimulator
    from engine.estimates.step_cost import calibrate
    from engine.generation.compiled_step import compile_decoder
    from engine.generation.core import CoreSettings
    from engine.load.prompts import Prompt, read_prompts
    from engine.models.loading import LoadRequest, load_model

    shipped = read_prompts()
    workloads = [("short questions, 64-token answers", [p for p in shipped if p.kind == "short"], 64),
                 ("long documents, 32-token answers", [p for p in shipped if p.kind == "long"], 32)]
    if args.shared_prefix:
        workloads = [(f"{name}, behind a shared preamble", [Prompt(PREAMBLE + p.text, p.kind) for p in prompts],
                      tokens) for name, prompts, tokens in workloads[:1]]
    print(f"CPU flags: {cpu_flags()}")
    print(f"the server on CPUs {server_cpus} with {len(server_cpus)} matmul threads, the load generator on "
          f"{client_cpus}")
    print(f"simulating 10,000 requests took {speed():.2f} s (target < 5 s)")
    rows = []
    for precision in args.precisions.split(","):
        os.sched_setaffinity(0, server_cpus)  # its steps timed where the server will run them
        loaded = load_model(LoadRequest("default", precision))
        if loaded.fast is not None:
            # built into the cache once (the server then loads it), for the server's thread count:
            # steps compiled for another count never run, and the eager steps' figures differ
            compile_decoder(loaded.fast, threads=len(server_cpus))
        per_token = loaded.info.kv_bytes_per_token
        kv_budget = None
        if args.small_kv:  # four requests' worst case: 16 at once must preempt
            longest = max(len(i) for _, prompts, _ in workloads for i in token_ids(loaded, prompts)) + 64
            kv_budget = 4 * (longest + 16) * per_token
        from engine.base.memory import default_kv_budget

        settings = CoreSettings(token_budget=128, max_batch=16, kv_budget_bytes=kv_budget or
                                default_kv_budget(loaded.device), prefix_caching=True)
        cost = calibrate(loaded, settings, args.calibrate_seconds)
        print(f"\n{precision}: {cost.describe()}; median error on its own steps {cost.error:.1%}")
        limits = EngineLimits.of(settings, per_token)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        extra = ("--kv-budget", str(kv_budget)) if kv_budget else ()
        # its threads fixed, one a CPU of its own: never given up to the load generator's work
        server = start_server(port, precision, threads=len(server_cpus), extra=extra, cpus=server_cpus)
        os.sched_setaffinity(0, client_cpus)
        try:
            wait_healthy(f"{url}/health", server)
            if loaded.fast is not None:
                ready_when_compiled(server)
            simulator = ServingSimulator(limits, cost)  # the server's twin: its prefix cache kept as the server's
            for name, prompts, tokens in workloads:
                ids = token_ids(loaded, prompts)
                # fitted to the workload's own prompts, as `load --predict` fits it to the load's
                front = fit_front_end(f"{url}/v1", None, None, prompts, ids, simulator).front
                print(f"  {name}: {front.describe()}")
                warm_up, _ = run_plan(f"{url}/v1", prompts, {"concurrency": (1,), "requests": 2, "max_tokens": 8})
                predict(warm_up, ids, simulator)
                saturation = None
                for i, extra_args in enumerate([{"concurrency": (c,)} for c in (1, 4, 16)] + [None, None, None]):
                    if extra_args is None:  # the open loops, once the saturation is known
                        extra_args = {"rates": (round(saturation * (0.3, 0.6, 0.9)[i - 3], 3),)}
                    requests = max(args.requests, 3 * extra_args.get("concurrency", (0,))[0])
                    again = []
                    for _ in range(args.repeat):
                        row = measure(url, prompts, ids, simulator, precision, name,
                                      {**extra_args, "requests": requests, "max_tokens": tokens})
                        report(row, len(again))
                        again.append(row)
                    if extra_args.get("concurrency") == (16,):
                        saturation = again[0][3].request_throughput
                    rows.append(again)
                    if len(again) > 1:
                        report_repeats(again)
        finally:
            stop(server)
        del loaded
    summarize_errors(rows)


def measure(url: str, prompts, ids: list[list[int]], simulator, precision: str, name: str, plan_args: dict) -> tuple:
    """One setting sent to the server and simulated: (precision, workload, setting, measured,
    predicted, preemptions measured and simulated, steps ×, the TTFT split)."""
    from engine.estimates.predict_load import served_speed, served_steps, steps_between  # lazy: after main() pins
    from engine.load.report import ttft_split  # lazy: after main() pins

    before, steps_before = scrape(url), served_steps(f"{url}/v1", None)
    plan, setting = run_plan(f"{url}/v1", prompts, plan_args)
    preempted = scrape(url).get("vllm:num_preemptions_total", 0) - before.get("vllm:num_preemptions_total", 0)
    steps_after = served_steps(f"{url}/v1", None)
    counted = {r.prompt_tokens for r in setting.results if r.prompt_tokens is not None}
    if not counted <= {len(i) for i in ids}:
        print(f"  (the server counted prompts of {sorted(counted)[:4]}… tokens, not these)")
    simulated = predict(plan, ids, simulator)
    # the server's own steps in this setting, as its /metrics summed them, against what the
    # prediction's step cost says of the same steps: the machine's speed
    pace = served_speed(simulator.cost, steps_between(steps_before, steps_after))
    return (precision, name, setting.label, setting.summary, simulated.summary, preempted, simulated.preemptions,
            pace, ttft_split(setting, simulated))


FIGURES = ("ttft median", "ttft p90", "tpot median", "tpot p90", "tok/s")


def figures(summary) -> dict[str, float | None]:
    """A summary's figures the targets are set on (latencies in seconds)."""
    out = {f"{key} {q}": (getattr(summary, key) or {}).get(q) for key in ("ttft", "tpot") for q in ("median", "p90")}
    out["tok/s"] = summary.output_throughput
    return out


def errors(row) -> dict[str, float | None]:
    """Each figure's error in one run of a setting."""
    measured, predicted = figures(row[3]), figures(row[4])
    return {figure: error(predicted[figure], measured[figure]) for figure in FIGURES}


def run_errors(repeats: list[tuple]) -> dict[str, list[float]]:
    """Each figure's error in every run of a setting (a figure some run lacks is left out)."""
    runs = [errors(row) for row in repeats]
    every = {figure: [run[figure] for run in runs] for figure in FIGURES}
    return {figure: values for figure, values in every.items() if None not in values}


def half_range(values: list[float]) -> float:
    return (max(values) - min(values)) / 2


def report_repeats(repeats: list[tuple]) -> None:
    """How far each figure's error moved from one run of the setting to the next: the server's
    own noise (the runs needn't measure the same: the first may find fewer prompts cached, and
    each run is predicted as it was)."""
    parts = [f"{figure} ±{half_range(values):.0%}" for figure, values in run_errors(repeats).items()]
    print(f"  {'':24} {'errors apart':18} " + " · ".join(parts))


def report(row, again: int = 0) -> None:
    precision, name, label, measured, predicted, preempted, simulated_preemptions, pace, split = row
    if again:
        name, label = "", f"again ({again + 1})"
    parts = []
    for key in ("ttft", "tpot"):
        for q in ("median", "p90"):
            m = (getattr(measured, key) or {}).get(q)
            p = (getattr(predicted, key) or {}).get(q)
            e = error(p, m)
            parts.append(f"{key} {q} {m * 1e3 if m else float('nan'):7.1f} / {p * 1e3 if p else float('nan'):7.1f} ms"
                         f" ({e:+.0%})" if e is not None else f"{key} {q} —")
    e = error(predicted.output_throughput, measured.output_throughput)
    parts.append(f"tok/s {measured.output_throughput:6.1f} / {predicted.output_throughput:6.1f} ({e:+.0%})")
    if preempted or simulated_preemptions:
        parts.append(f"preemptions {preempted:g} / {simulated_preemptions}")
    if split is not None:  # where the TTFT's error lies: the server's own part, or its client's
        e = error(split.predicted_server_s, split.server_s)
        parts.append(f"TTFT mean: server {split.server_s * 1e3:.1f} / {split.predicted_server_s * 1e3:.1f} ms"
                     + (f" ({e:+.0%})" if e is not None else "")
                     + f", client {split.client_s * 1e3:.1f} / {split.predicted_client_s * 1e3:.1f} ms")
    if pace is not None:
        parts.append(f"steps ×{pace:.2f}")
    print(f"  {name[:24]:24} {label:18} " + " · ".join(parts))


def summarize_errors(rows: list[list[tuple]]) -> None:
    """The targets over every run of every setting, and how far a setting's errors moved between
    its runs."""
    worst = {"ttft": 0.0, "tpot": 0.0, "tok/s": 0.0}
    latency, throughput, apart = [], [], {"latency": [], "tok/s": []}
    for repeats in rows:
        for figure, values in run_errors(repeats).items():
            kind = figure.split()[0]
            worst[kind] = max(worst[kind], *(abs(v) for v in values))
            (throughput if kind == "tok/s" else latency).extend(abs(v) for v in values)
            apart["tok/s" if kind == "tok/s" else "latency"].append(half_range(values))
    print(f"\nlargest errors (measured / predicted above): TTFT {worst['ttft']:.0%} (target ≤ 15%), "
          f"TPOT {worst['tpot']:.0%} (target ≤ 15%), throughput {worst['tok/s']:.0%} (target ≤ 10%); "
          f"{sum(e <= 0.15 for e in latency)}/{len(latency)} latencies within 15%, "
          f"{sum(e <= 0.10 for e in throughput)}/{len(throughput)} throughputs within 10%")
    if any(len(repeats) > 1 for repeats in rows):
        lat, tput = sorted(apart["latency"]), sorted(apart["tok/s"])
        print(f"a setting's errors from one run to the next: latencies ±{lat[len(lat) // 2]:.0%} apart (median), "
              f"{sum(n > 0.075 for n in lat)}/{len(lat)} more than ±7.5% (half the target), the most ±{lat[-1]:.0%}; "
              f"throughputs ±{tput[len(tput) // 2]:.0%}, the most ±{tput[-1]:.0%}")
    every = [row for repeats in rows for row in repeats]
    for precision in dict.fromkeys(row[0] for row in every):
        paces = [row[7] for row in every if row[0] == precision and row[7] is not None]
        if paces:
            print(f"{precision}: the server ran each setting's steps at ×{min(paces):.2f} to ×{max(paces):.2f} "
                  "the time the prediction's step cost gives the same steps")


if __name__ == "__main__":
    main()
