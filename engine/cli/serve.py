"""``inference-workbench serve`` (the loaded model behind an OpenAI-compatible API) and
``inference-workbench load`` (a load generator pointed at any such API)."""

from __future__ import annotations

import sys
from pathlib import Path

from engine.base.units import parse_numbers, parse_size
from engine.cli.text import add_kv_dtype

def add_parsers(sub, precisions) -> None:
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible API (continuous batching)")
    serve.add_argument("--model", default="default", help="'default', a folder, a .gguf file or a hub id")
    serve.add_argument("--precision", default="fp32", choices=list(precisions))
    serve.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    add_kv_dtype(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s; any "
                       "other than loopback needs --api-key)")
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port (default: %(default)s)")
    serve.add_argument("--api-key", help="clients must send 'Authorization: Bearer KEY' (default: none)")
    serve.add_argument("--max-batch", type=int, default=16, help="requests decoded together (default: %(default)s)")
    serve.add_argument("--kv-budget", help="KV-cache bytes the running requests and the prefix cache may hold "
                       "together, e.g. 2GiB (default: a quarter of the free memory, at most 4 GiB; 90%% of a GPU's)")
    serve.add_argument("--token-budget", type=int, default=128,
                       help="tokens per step: a decode token per running request, the rest prompt chunks "
                            "(default: %(default)s)")
    serve.add_argument("--max-waiting", type=int, default=256, help="waiting requests before 429 (default: "
                       "%(default)s)")
    serve.add_argument("--batch-invariant", action="store_true",
                       help="every answer the one it gets alone, whatever else runs beside it (as vLLM's "
                            "--batch-invariant): products in fixed tiles, no compiled steps, prompts in aligned "
                            "chunks; slower (docs/benchmarks.md)")
    serve.add_argument("--no-prefix-caching", action="store_true",
                       help="don't keep computed prompt blocks for later requests that begin the same way "
                            "(kept by default, as vLLM keeps them)")
    serve.add_argument("--stream-interval", type=int, default=1,
                       help="tokens per streamed chunk, as vLLM's option (default: %(default)s)")
    serve.add_argument("--default-max-tokens", type=int,
                       help="answer limit of a request without max_tokens (default: the model's generation_config "
                            "max_new_tokens, else 512)")
    serve.add_argument("--served-model-name", help="the model name clients send (default: the model's)")
    serve.add_argument("--no-history", action="store_true", help="don't add served requests to the run history")
    serve.add_argument("--offline", action="store_true", help="never contact the Hugging Face hub")

    load = sub.add_parser("load", help="send a measured load to an OpenAI-compatible server (ours or any)")
    load.add_argument("--url", required=True, help="the API's base URL, e.g. http://127.0.0.1:8000/v1")
    load.add_argument("--model", help="the model name (default: the first the server lists)")
    load.add_argument("--api-key", help="API key (default: $INFERENCE_WORKBENCH_API_KEY, else $OPENAI_API_KEY)")
    load.add_argument("--no-history", action="store_true", help="don't add the settings to the run history")
    mode = load.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", help="closed loop: this many requests in flight, e.g. 1,4,16 (a sweep)")
    mode.add_argument("--rate", help="open loop: requests per second arriving, e.g. 0.5,1,2 (a sweep)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier, > 1 steadier")
    load.add_argument("--requests", type=int, default=32, help="requests per setting (default: %(default)s)")
    load.add_argument("--max-duration", type=float, default=300.0,
                      help="seconds per setting: then requests in flight are cut (failed) and the rest not sent "
                      "(default: %(default)s)")
    load.add_argument("--prompts", type=Path, help="prompts, one JSON object per line ({\"prompt\": …}) or "
                      "plain text lines (default: the shipped set, short and long)")
    load.add_argument("--max-tokens", type=int, default=128, help="tokens per answer (default: %(default)s)")
    load.add_argument("--ignore-eos", action="store_true",
                      help="ask for exactly --max-tokens tokens (vLLM's extension; servers without it refuse)")
    load.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    load.add_argument("--slo", help="goodput counts requests within these, e.g. ttft:500,tpot:50 (ms)")
    load.add_argument("--seed", type=int, default=0, help="seed of the prompt order and arrival gaps")
    load.add_argument("--predict", action="store_true",
                      help="beside each setting, the serving simulator's prediction for it (this workbench's "
                      "server: its model is loaded here and its steps timed once)")
    load.add_argument("--predict-model", default="default",
                      help="with --predict: the served model as this machine loads it (default: %(default)s)")
    load.add_argument("--json", type=Path, help="write every request's figures and the summaries here")
    load.add_argument("--csv", type=Path, help="write a row per setting here (servers line up in one sheet)")

    simulate = sub.add_parser("simulate", help="replay a recorded load (load --json) through the serving simulator, "
                                               "with the server's limits or others")
    simulate.add_argument("trace", type=Path, help="a load generator's report (load --json FILE)")
    simulate.add_argument("--model", default="default",
                          help="the served model as this machine loads it (default: %(default)s)")
    simulate.add_argument("--precision", choices=list(precisions), help="(default: the recorded server's)")
    simulate.add_argument("--max-batch", type=int, help="requests decoded together (default: the recorded server's)")
    simulate.add_argument("--token-budget", type=int, help="tokens one step may take (default: the recorded server's)")
    simulate.add_argument("--kv-budget", help="KV-cache bytes, e.g. 64MiB (default: the recorded server's)")
    simulate.add_argument("--prefix-caching", choices=["on", "off"], help="(default: the recorded server's)")


def serve(args, load_printer) -> int:
    from engine.models.loading import LoadRequest, load_model  # lazy: start-up
    from engine.serve.server import Server, ServeSettings  # lazy: start-up

    settings = ServeSettings(host=args.host, port=args.port, api_key=args.api_key, max_batch=args.max_batch,
                             kv_budget_bytes=parse_size(args.kv_budget) if args.kv_budget else None,
                             max_waiting=args.max_waiting, token_budget=args.token_budget,
                             history=not args.no_history,
                             model_name=args.served_model_name, stream_interval=args.stream_interval,
                             default_max_tokens=args.default_max_tokens,
                             prefix_caching=not args.no_prefix_caching,
                             batch_invariant=args.batch_invariant).validated()
    print(f"Loading {args.model} ({args.precision}) …", file=sys.stderr, flush=True)
    loaded = load_model(LoadRequest(model=args.model, precision=args.precision, device=args.device,
                                    offline=True if args.offline else None, kv_dtype=args.kv_dtype),
                        progress=load_printer)
    server = Server(loaded, settings)
    if loaded.fast is not None:  # the compiled steps (one sequence, batches) run once they are ready
        from engine.generation.compiled_step import compile_in_background, stop_compiling  # lazy: start-up

        print("Fast path: getting the compiled decode steps ready in the background (one sequence, then batches) …",
              file=sys.stderr, flush=True)
        compile_in_background(loaded.fast, lambda report: print(f"Fast path: {report.describe()}", file=sys.stderr,
                                                                flush=True))
    from engine.base.units import format_bytes  # lazy: start-up

    print(f"Serving {server.model_name} at {server.url} (batch up to {settings.max_batch}, KV budget "
          f"{format_bytes(server.service.settings.kv_budget_bytes)}); Ctrl-C stops.", flush=True)
    print(f"  {server.defaults.describe()}", flush=True)
    print(f"  {server.service.describe_kv()}", flush=True)
    print(f"  curl -N {server.url}/chat/completions -H 'Content-Type: application/json' -d "
          f"'{{\"model\": \"{server.model_name}\", \"max_tokens\": 64, "
          f"\"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}]}}'",
          flush=True)
    server.drain = False  # Ctrl-C: every open stream ends now, with its last chunk
    server.serve_forever()
    if loaded.fast is not None:
        stop_compiling(loaded.fast, timeout=5)
    print(f"stopped after {server.service.served} requests", file=sys.stderr)
    return 0


def load(args) -> int:
    from engine.endpoint import api_key_from_env  # lazy: start-up
    from engine.load.generator import LoadPlan, LoadRunner  # lazy: start-up
    from engine.load.metrics import parse_slo  # lazy: start-up
    from engine.load.prompts import read_prompts  # lazy: start-up

    if args.concurrency is None and args.rate is None:
        args.concurrency = "1"
    plan = LoadPlan(
        url=args.url, model=args.model, api_key=args.api_key or api_key_from_env(),
        concurrency=tuple(parse_numbers(args.concurrency, int)) if args.concurrency else (),
        rates=tuple(parse_numbers(args.rate)) if args.rate else (), burstiness=args.burstiness,
        requests=args.requests, max_duration_s=args.max_duration, max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos, endpoint=args.endpoint, seed=args.seed,
        slo=parse_slo(args.slo) if args.slo else None).validated()
    prompts = read_prompts(args.prompts)
    from engine.load.report import predicted_line, summary_header, summary_line, write_json  # lazy: start-up

    predictor = _predictor(args, plan, prompts) if args.predict else None

    def said(result) -> None:
        print(summary_line(result), flush=True)
        if predictor is not None:
            from engine.load.report import split_line, ttft_split  # lazy: start-up

            predicted = predictor.predict(plan, result)
            print(predicted_line(predicted.summary, result.summary), flush=True)
            split = ttft_split(result, predicted)
            if split is not None:
                print(split_line(split), flush=True)

    print(summary_header(plan), flush=True)
    results = LoadRunner(plan, prompts, on_result=said).run()
    if not args.no_history:
        from engine.load.report import remember  # lazy: start-up

        remember(plan, results)
    if args.json:
        write_json(args.json, plan, results)
        print(f"report   {args.json}")
    if args.csv:
        from engine.load.report import write_csv  # lazy: start-up

        write_csv(args.csv, results)
        print(f"table    {args.csv}")
    return 0 if all(r.summary.completed for r in results) else 1


def _predictor(args, plan, prompts):
    """The simulator standing in for the server ``plan`` loads (``load --predict``)."""
    from engine.estimates.predict_load import predictor_for, server_meta  # lazy: the engine (torch)

    meta, served = server_meta(plan.url, plan.api_key, plan.model)
    return predictor_for(meta, args.predict_model, prompts, plan.endpoint, url=plan.url, api_key=plan.api_key,
                         served=served)


def simulate(args) -> int:
    """``simulate TRACE``: each recorded setting, as it was measured and as the simulator predicts it."""
    import json  # lazy: start-up

    from engine.base.errors import InvalidRequestError  # lazy: start-up
    from engine.estimates.predict_load import replay  # lazy: the engine (torch)
    from engine.load.report import predicted_line, summary_header  # lazy: start-up

    try:
        report = json.loads(args.trace.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"Could not read {args.trace}: {exc}") from None
    if not isinstance(report, dict):
        raise InvalidRequestError(f"{args.trace} is not a load generator's report (load --json).")
    changes = {key: value for key, value in (("max_batch", args.max_batch), ("token_budget", args.token_budget),
                                             ("prefix_caching", None if args.prefix_caching is None else
                                              args.prefix_caching == "on")) if value is not None}
    for key, value in changes.items():
        if key != "prefix_caching" and value < 1:
            raise InvalidRequestError(f"--{key.replace('_', '-')} must be at least 1.")
    budget = parse_size(args.kv_budget) if args.kv_budget else None
    rows = replay(report, args.model, changes, args.precision, budget)
    print(summary_header(note="(ms; recorded, then simulated: the engine's steps alone, no front end)"))
    for label, run, measured in rows:
        print(predicted_line(measured, name=label), flush=True)
        print(predicted_line(run.summary, measured if not changes and budget is None else None, "  simulated")
              + f"\n    {run.preemptions} preempted in the simulation", flush=True)
    return 0

