"""``inference-workbench`` on the command line: bench, compare, sweep, estimate, hardware, models, serve,
load, perplexity.

Errors end the program with one line on stderr and a non-zero exit code; ``--debug``
shows the traceback. Each command imports what it runs inside its function (``# lazy: start-up``):
``--help`` and the window's launch import a fraction of what the commands need
(benchmarks/window_startup.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from engine.base.errors import EngineError, InvalidRequestError
from engine.base.units import format_bytes, format_rate, format_seconds
import engine.cli.quality as cli_quality
import engine.cli.serve as cli_serve
from engine.cli.text import add_kv_dtype, compare_table, estimate_summary, speculative_summary, summary

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"error: {message} (see {self.prog} --help)\n")


def _add_request_args(parser: argparse.ArgumentParser) -> None:
    """Prompt, mode, length and sampling: what bench and compare share."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="the prompt; '-' reads standard input")
    source.add_argument("--prompt-file", type=Path, help="read the prompt from a file")
    parser.add_argument("--system", help="system prompt (chat mode)")
    parser.add_argument("--raw", action="store_true", help="continue the text as is, no chat template")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--greedy", action="store_true", help="always pick the most likely token (the default)")
    parser.add_argument("--temperature", type=float, default=None, help="> 0 samples")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-new-tokens tokens")
    parser.add_argument("--json", type=Path, help="write the full report here")
    parser.add_argument("--quiet", action="store_true", help="don't stream the answer")


def build_parser() -> argparse.ArgumentParser:
    from engine.models.precision import PRECISIONS  # lazy: start-up

    parser = _Parser(prog="inference-workbench",
                     description="See what happens behind an LLM API call, measured live.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    bench = sub.add_parser("bench", help="load a model, generate once, print what it cost")
    bench.add_argument("--model", default="default",
                       help="'default', a folder, a .gguf file, a hub id, or a served model, "
                            "endpoint:http://HOST:PORT/v1#MODEL (key from $INFERENCE_WORKBENCH_API_KEY or "
                            "$OPENAI_API_KEY) (default: %(default)s)")
    bench.add_argument("--precision", default="fp32", choices=list(PRECISIONS), help="(default: %(default)s)")
    bench.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    add_kv_dtype(bench)
    _add_request_args(bench)
    bench.add_argument("--offline", action="store_true", help="never contact the Hugging Face hub")
    bench.add_argument("--trust-remote-code", action="store_true",
                       help="run Python code shipped with a hub model (only if you trust it)")
    bench.add_argument("--allow-pickle", action="store_true",
                       help="read pickle .bin checkpoints, which can run code (only if you trust them)")
    bench.add_argument("--compile", action="store_true",
                       help="with a *-fast precision: make the compiled decode step ready first (built by a child "
                            "process, 1-2 minutes the first time; loaded in seconds once cached) and say how")
    bench.add_argument("--draft", metavar="ngram[:N]|early-exit:K|default:PRECISION|PATH[:PRECISION]",
                       help="speculative decoding with this draft: prompt lookup (the tokens that followed the "
                            "last N tokens' latest earlier occurrence in the prompt and answer; no model), the "
                            "target's first K layers, the default model at a precision, or another model with "
                            "the same tokenizer")
    bench.add_argument("--draft-tokens", type=int, default=4, metavar="N",
                       help="tokens the draft proposes per step (default: %(default)s)")
    bench.add_argument("--compare-plain", action="store_true",
                       help="with --draft: also decode plainly first and report the speed-up, beside the one "
                            "predicted from the acceptance rate and what a guess and a check cost")

    sweep = sub.add_parser("sweep", help="batch sizes 1, 2, 4…: throughput against per-request latency and memory")
    sweep.add_argument("--model", default="default", help="'default', a folder, a .gguf file or a hub id")
    sweep.add_argument("--precision", default="fp32", choices=list(PRECISIONS))
    sweep.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    add_kv_dtype(sweep)
    sweep.add_argument("--batch", default="1,2,4,8", help="comma-separated batch sizes (default: %(default)s)")
    sweep.add_argument("--no-history", action="store_true", help="don't add the points to the run history")
    _add_request_args(sweep)
    sweep.add_argument("--stop-at-eos", dest="ignore_eos", action="store_false",
                       help="let sequences end at end-of-sequence (by default each makes exactly --max-new-tokens)")
    sweep.set_defaults(max_new_tokens=64, ignore_eos=True)

    compare = sub.add_parser("compare", help="one prompt through 2-4 models or precisions, and where they differ")
    compare.add_argument("--lane", action="append", required=True, metavar="MODEL:PRECISION[@KV][:DEVICE]",
                         help="a lane, e.g. default:fp32 or default:int8-fast@int8 (an int8 KV cache), or a served "
                              "model, endpoint:http://HOST:PORT/v1#MODEL "
                              "(key from $INFERENCE_WORKBENCH_API_KEY or $OPENAI_API_KEY); repeat 1-4 times, "
                              "lane 1 is the reference")
    compare.add_argument("--schedule", choices=["fair", "concurrent"], default="fair",
                         help="fair: one lane after another (clean timings); concurrent: all at once")
    _add_request_args(compare)
    compare.add_argument("--csv", type=Path, help="write the summary table here")

    estimate = sub.add_parser("estimate", help="predict memory, the speed ceiling and $ per 1M tokens")
    estimate.add_argument("--model", default="default",
                          help="a shipped config (e.g. meta-llama/Llama-3.1-8B), a folder, a hub id or 'default'")
    estimate.add_argument("--precision", default="bf16", help="fp32, bf16, fp16, int8, nf4, fp4, q8_0, q4_k, q4_1…")
    estimate.add_argument("--kv-dtype", default="bf16", help="fp32, bf16, fp16, fp8, int8, int4")
    estimate.add_argument("--context", type=int, default=4096, help="tokens in the KV cache per sequence")
    estimate.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    estimate.add_argument("--hardware", default="this-machine", help="a profile id (inference-workbench hardware)")
    estimate.add_argument("--training-tokens", type=float, help="tokens the model was trained on, e.g. 15e12")
    estimate.add_argument("--gpus", action="store_true",
                          help="plan tensor parallelism: how many GPUs of --hardware, what each holds, the "
                               "interconnect traffic, the ceiling, and the vLLM and SGLang commands")
    estimate.add_argument("--json", type=Path, help="write the estimate here")

    hardware = sub.add_parser("hardware", help="list the hardware profiles (this machine measured once)")
    hardware.add_argument("--json", action="store_true", help="print JSON")
    hardware.add_argument("--measure", action="store_true", help="measure this machine again")

    sub.add_parser("models", help="list the default model and models in the Hugging Face cache")
    cli_serve.add_parsers(sub, PRECISIONS)
    cli_quality.add_parser(sub, PRECISIONS)
    for name, command in sub.choices.items():
        command.formatter_class = argparse.RawDescriptionHelpFormatter
        command.epilog = "example:\n  " + EXAMPLES[name]
    parser.commands = sub.choices
    parser.epilog = "commands:\n" + "\n".join(f"  {name:<11} {line}" for name, line in command_lines(sub))
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    return parser


EXAMPLES = {
    "bench": 'inference-workbench bench --model default --precision int8-fast --prompt "What is a KV cache?"',
    "sweep": "inference-workbench sweep --model default --precision bf16 --batch 1,2,4,8 --max-new-tokens 64",
    "compare": 'inference-workbench compare --lane default:fp32 --lane default:int8 --prompt "What is a KV cache?"',
    "estimate": "inference-workbench estimate --model meta-llama/Llama-3.1-8B --hardware h100-sxm --context 8192",
    "hardware": "inference-workbench hardware --measure",
    "models": "inference-workbench models",
    "serve": "inference-workbench serve --model default --precision int8-fast --port 8000",
    "load": "inference-workbench load --url http://127.0.0.1:8000/v1 --concurrency 1,4 --requests 32",
    "simulate": "inference-workbench simulate load.json --max-batch 32 --kv-budget 256MiB",
    "perplexity": "inference-workbench perplexity --model default --precision int8-fast --reference fp32-fast",
}
"""One example of each subcommand, at the end of its --help."""


def command_lines(sub=None) -> list[tuple[str, str]]:
    """Each subcommand's name and one line on what it does (the window's --help lists them too)."""
    if sub is None:
        sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [(action.dest, action.help) for action in sub._choices_actions]


def _read_prompt(args) -> str:
    if args.prompt_file is not None:
        try:
            return args.prompt_file.read_text(encoding="utf-8")
        except OSError as exc:
            raise InvalidRequestError(f"Can't read the prompt file: {exc}") from exc
    if args.prompt == "-" or (args.prompt is None and not sys.stdin.isatty()):
        text = sys.stdin.read()
        if not text.strip():
            raise InvalidRequestError("No prompt: standard input was empty; pass --prompt TEXT or --prompt-file FILE.")
        return text
    if args.prompt is None:
        raise InvalidRequestError("No prompt: pass --prompt TEXT, --prompt-file FILE, or pipe it in.")
    return args.prompt


class _LoadPrinter:
    """Prints loading stages to stderr, one line per stage."""

    def __init__(self) -> None:
        self._stage = None

    def __call__(self, event) -> None:
        if event.stage != self._stage:
            self._stage = event.stage
            print(f"  {event.stage:<9} {event.message}", file=sys.stderr, flush=True)


def _request(args):
    from engine.base.request import GenerationRequest  # lazy: start-up
    from engine.base.sampling import SamplingParams  # lazy: start-up

    if args.greedy and args.temperature not in (None, 0):
        raise InvalidRequestError("--greedy and --temperature > 0 contradict each other.")
    sampling = SamplingParams(temperature=args.temperature or 0.0, top_k=args.top_k, top_p=args.top_p,
                              min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed)
    return GenerationRequest(
        prompt=_read_prompt(args), mode="raw" if args.raw else "chat", system_prompt=args.system,
        sampling=sampling, max_new_tokens=args.max_new_tokens, stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    ).validated()


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
    print(f"report   {path}")


def _bench(args) -> int:
    from engine.endpoint import is_endpoint  # lazy: start-up
    from engine.measure import bench  # lazy: start-up
    from engine.base.cancel import CancelToken  # lazy: start-up
    from engine.base.events import TokenGenerated  # lazy: start-up
    from engine.models.loading import LoadRequest, load_model  # lazy: start-up

    request = _request(args)
    if is_endpoint(args.model) and (args.draft or args.compile):
        raise InvalidRequestError("--draft and --compile run the model here, not on a server.")
    if args.compare_plain and not args.draft:
        raise InvalidRequestError("--compare-plain compares with speculative decoding: add --draft.")
    if args.draft:
        from engine.generation.speculative import MAX_DRAFT_TOKENS  # lazy: start-up

        if not 1 <= args.draft_tokens <= MAX_DRAFT_TOKENS:
            raise InvalidRequestError(f"--draft-tokens must be from 1 to {MAX_DRAFT_TOKENS}.")

    print(f"Connecting to {args.model} …" if is_endpoint(args.model) else f"Loading {args.model} ({args.precision}) …",
          file=sys.stderr, flush=True)
    loaded = load_model(
        LoadRequest(model=args.model, precision=args.precision, device=args.device,
                    trust_remote_code=args.trust_remote_code, allow_pickle=args.allow_pickle,
                    offline=True if args.offline else None, kv_dtype=args.kv_dtype),
        progress=_LoadPrinter(),
    )
    loaded.encode(request)  # refuse an over-long prompt before printing anything else
    compiled = None
    if args.compile:
        if loaded.fast is None:
            raise InvalidRequestError("--compile needs a fast-path precision (fp32-fast, bf16-fast, int8-fast, int4-fast).")
        print("Getting the compiled decode step ready …", file=sys.stderr, flush=True)
        from engine.generation.compiled_step import compile_decoder  # lazy: start-up

        # one request needs the batched step only to check a draft's guesses (several rows at once)
        compiled = compile_decoder(loaded.fast, rows=bool(args.draft))
        print(f"  {compiled.describe()}", file=sys.stderr)
    draft = None
    if args.draft:
        from engine.generation.speculative import load_draft, parse_draft  # lazy: start-up

        spec = parse_draft(args.draft, args.precision)
        print(f"Draft {spec.label} …", file=sys.stderr, flush=True)
        draft = load_draft(spec, loaded, progress=_LoadPrinter())
        if args.compile and draft.fast is not None:  # its own compiled step, readied beside the target's
            draft.wait_for_compile()
            state = "ready" if draft.fast.compiled is not None else "not ready: its guesses run the eager step"
            print(f"  the draft's compiled step {state}", file=sys.stderr)

    def on_event(event) -> None:
        if not args.quiet and isinstance(event, TokenGenerated):
            sys.stdout.write(event.text)
            sys.stdout.flush()

    cancel = CancelToken()
    try:
        if draft is None:
            result = bench.run(loaded, request, cancel, on_event)
        else:
            from engine.measure.speculative_run import speculative_report  # lazy: start-up

            def on_run_event(run: str, event) -> None:
                if run == "plain" and isinstance(event, TokenGenerated) and event.index == 0:
                    print("[plain decoding, for the speed-up]", file=sys.stderr, flush=True)
                if run == "speculative" and not hasattr(on_run_event, "started"):
                    on_run_event.started = True
                    if args.compare_plain:
                        print("\n[speculative decoding]", file=sys.stderr, flush=True)
                if run == "speculative" or not args.quiet:
                    on_event(event)

            report = speculative_report(loaded, draft, request, args.draft_tokens, args.compare_plain, cancel,
                                        on_run_event)
            result = {**bench.report(loaded.info, request, report.run), **report.summary()}
    except KeyboardInterrupt:
        cancel.cancel()
        raise
    if not args.quiet:
        print()
    print(summary(result))
    if draft is not None:
        print(speculative_summary(report))
    if compiled is not None:
        result["compile_s"] = compiled.seconds
        result["compiled"] = not compiled.error
        result["compile_built"] = compiled.built
    if args.json is not None:
        _write_json(args.json, result)
    return 0


def _sweep(args) -> int:
    from engine.base.cancel import CancelToken  # lazy: start-up
    from engine.base.events import BatchFinished  # lazy: start-up
    from engine.models.loading import LoadRequest, load_model  # lazy: start-up
    from engine.measure.sweep import record_points, run_sweep  # lazy: start-up
    from engine.endpoint import is_endpoint  # lazy: start-up

    if is_endpoint(args.model):
        raise InvalidRequestError("A batch sweep runs the model here; to load a server with several requests at "
                                  "once, use: inference-workbench load --url URL --concurrency 1,4,16")
    try:
        batches = [int(b) for b in str(args.batch).split(",") if b.strip()]
    except ValueError:
        raise InvalidRequestError(f"--batch takes comma-separated whole numbers, not {args.batch!r}.") from None
    request = _request(args)
    print(f"Connecting to {args.model} …" if is_endpoint(args.model) else f"Loading {args.model} ({args.precision}) …",
          file=sys.stderr, flush=True)
    loaded = load_model(LoadRequest(model=args.model, precision=args.precision, device=args.device,
                                    kv_dtype=args.kv_dtype), progress=_LoadPrinter())
    prompt_tokens = len(loaded.encode(request))
    print(f"{'batch':>5} {'tok/s (all)':>12} {'tok/s each':>11} {'TTFT':>9} {'per token':>10} {'KV cache':>10} "
          f"{'peak mem':>10} {'ceiling':>12}")

    def on_point(point) -> None:
        each = point.aggregate_tokens_per_s / point.batch if point.aggregate_tokens_per_s else None
        ceiling = point.predicted_tokens_per_s_ceiling
        share = (f" ({100 * point.aggregate_tokens_per_s / ceiling:.0f}%)"
                 if ceiling and point.aggregate_tokens_per_s else "")
        print(f"{point.batch:>5} {format_rate(point.aggregate_tokens_per_s, ''):>12} {format_rate(each, ''):>11} "
              f"{format_seconds(point.mean_ttft_s):>9} {format_seconds(point.mean_per_token_latency_s):>10} "
              f"{format_bytes(point.kv_cache_bytes):>10} {format_bytes(point.peak_memory_bytes):>10} "
              f"{format_rate(ceiling, ''):>6}{share}", flush=True)

    def on_event(batch: int, event) -> None:
        if isinstance(event, BatchFinished) and event.cancelled:
            print(f"batch {batch} cancelled", file=sys.stderr)

    cancel = CancelToken()
    try:
        points, skipped = run_sweep(loaded, request, batches, cancel, on_event=on_event, on_point=on_point)
    except KeyboardInterrupt:
        cancel.cancel()
        raise
    for skip in skipped:
        print(f"skipped  {skip.reason}")
    if points and not args.no_history:
        record_points(loaded, points, prompt_tokens)
    if args.json is not None:
        from engine.measure import bench  # lazy: start-up

        info = loaded.info
        _write_json(args.json, {
            "model": info.name, "model_ref": info.path if info.source != "default" else "default",
            "precision": info.precision, "device": info.device, "device_name": info.device_name,
            "parameters": info.parameters, "weights_bytes": info.weights_bytes, "prompt_tokens": prompt_tokens,
            "max_new_tokens": request.max_new_tokens, "ignore_eos": request.ignore_eos,
            "points": [p.to_dict() for p in points],
            "skipped": [{"batch": s.batch, "predicted_extra_bytes": s.predicted_extra_bytes,
                         "available_bytes": s.available_bytes, "reason": s.reason} for s in skipped],
            "versions": bench.versions(),
        })
    return 0


def _compare(args) -> int:
    from engine.measure import compare  # lazy: start-up
    from engine.base.events import TokenGenerated  # lazy: start-up

    if not 1 <= len(args.lane) <= 4:
        raise InvalidRequestError("Give 1 to 4 --lane options.")
    specs = [compare.parse_lane(text) for text in args.lane]
    request = _request(args)
    printer = _LoadPrinter()
    current = [-1]

    def on_event(index: int, event) -> None:
        if index != current[0] and args.schedule == "fair":
            current[0] = index
            print(f"\n[lane {index + 1}: {specs[index].label}]", file=sys.stderr, flush=True)
        if hasattr(event, "stage"):
            printer(event)
        elif isinstance(event, TokenGenerated) and not args.quiet and args.schedule == "fair":
            sys.stdout.write(event.text)
            sys.stdout.flush()

    runs = compare.run_comparison(specs, request, args.schedule, on_event)
    result = compare.to_record(runs, request, args.schedule)  # the report, plus every event: reopens in the app
    rows = compare.summary_rows(runs)
    print("\n" + compare_table(rows))
    if args.json is not None:
        _write_json(args.json, result)
    if args.csv is not None:
        compare.write_csv(args.csv, rows)
        print(f"table    {args.csv}")
    return 0


def _estimate(args) -> int:
    from engine.estimates import costs  # lazy: start-up
    from engine.estimates import hardware  # lazy: start-up
    from engine.estimates.estimate import config_for  # lazy: start-up

    config = config_for(args.model)
    if config is None:
        raise InvalidRequestError(
            f"No config for {args.model!r} on this machine: use a shipped one "
            f"({', '.join(_shipped())}), a model folder, or a hub id in the Hugging Face cache.")
    result = costs.estimate(config, hardware.get(args.hardware), args.precision, args.kv_dtype, args.context,
                            args.batch, args.training_tokens, model=args.model)
    data = result.to_dict()
    print(estimate_summary(result, hardware.get(args.hardware)))
    if args.gpus:
        from engine.cli.text import parallel_summary  # lazy: start-up
        from engine.estimates.parallel import plan_tensor_parallel  # lazy: start-up

        plan = plan_tensor_parallel(config, hardware.get(args.hardware), args.precision, args.kv_dtype, args.context,
                                    args.batch, model=args.model)
        print(parallel_summary(plan))
        data["tensor_parallel"] = plan.to_dict()
    if args.json is not None:
        _write_json(args.json, data)
    return 0


def _shipped() -> list[str]:
    from engine.estimates.estimate import shipped_models  # lazy: start-up

    return shipped_models()


def _hardware(args) -> int:
    from engine.estimates import hardware  # lazy: start-up

    found = hardware.profiles(measure=args.measure)
    if args.json:
        print(json.dumps([p.to_dict() for p in found], indent=2))
        return 0
    for p in found:
        price = "—" if p.usd_per_hour is None else f"${p.usd_per_hour:.2f}/h"
        watts = "—" if p.watts is None else f"{p.watts:.0f} W"
        print(f"{p.id:<14} {p.name:<48} {format_bytes(p.memory_bytes):>10} {p.bandwidth_bytes_per_s / 1e9:8.1f} GB/s "
              f"{p.bf16_flops / 1e12:8.2f} TFLOP/s {price:>9} {watts:>7}")
    return 0


def _models(args) -> int:
    from engine.models.sources import list_models  # lazy: start-up

    for entry in list_models():
        size = format_bytes(entry.size_bytes) if entry.size_bytes else ""
        state = "ready" if entry.ready else "not downloaded yet"
        print(f"{entry.ref:<40} {entry.source:<8} {size:>10}  {state}  {entry.path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named against the subcommand's own help, not the window's
        (parser.commands[args.command] if args.command else parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 0
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        if args.command == "bench":
            return _bench(args)
        if args.command == "compare":
            return _compare(args)
        if args.command == "sweep":
            return _sweep(args)
        if args.command == "estimate":
            return _estimate(args)
        if args.command == "hardware":
            return _hardware(args)
        if args.command == "serve":
            return cli_serve.serve(args, _LoadPrinter())
        if args.command == "load":
            return cli_serve.load(args)
        if args.command == "simulate":
            return cli_serve.simulate(args)
        if args.command == "perplexity":
            return cli_quality.run(args, _LoadPrinter())
        return _models(args)
    except KeyboardInterrupt:
        print("\ncancelled", file=sys.stderr)
        return EXIT_INTERRUPTED
    except EngineError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:  # a bug of ours: still one line, unless --debug
        if args.debug:
            raise
        print(f"error: unexpected {type(exc).__name__}: {exc} (run with --debug for details)", file=sys.stderr)
        return EXIT_ERROR

