"""``inference-workbench perplexity``: a precision's perplexity over a text and its KL divergence
from a reference precision, as llama.cpp's ``llama-perplexity`` (``--kl-divergence``) measures
them (engine/measure/quality.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from engine.base.errors import InvalidRequestError
from engine.cli.text import add_kv_dtype


def add_parser(sub, precisions) -> None:
    p = sub.add_parser("perplexity", help="perplexity over a text, and KL divergence from a reference precision "
                                          "(llama.cpp's method)")
    p.add_argument("--model", default="default", help="'default', a folder, a .gguf file, a hub id, or a served "
                                                       "model (endpoint:http://HOST:PORT/v1#NAME) that returns prompt "
                                                       "log-probabilities (vLLM, inference-workbench serve)")
    p.add_argument("--precision", default="fp32", choices=list(precisions))
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    add_kv_dtype(p)
    p.add_argument("--text", type=Path, help="a UTF-8 text file (default: resources/quality-text.txt, ~30k tokens "
                                             "of Shakespeare)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default: %(default)s, as llama.cpp)")
    p.add_argument("--chunks", type=int, help="score only the first N chunks (default: all)")
    p.add_argument("--batch", type=int, help="chunks per forward pass (default: as many as fit in 256 MiB of logits)")
    ref = p.add_mutually_exclusive_group()
    ref.add_argument("--reference", metavar="PRECISION", choices=list(precisions),
                     help="KL divergence from this precision of the same model (computed once, kept in the user "
                          "cache for later runs)")
    ref.add_argument("--reference-file", type=Path, metavar="FILE",
                     help="KL divergence from a reference saved with --save-reference (llama.cpp's "
                          "--kl-divergence-base)")
    p.add_argument("--save-reference", type=Path, metavar="FILE", help="keep this run's distributions here")
    p.add_argument("--top-k", type=int, default=512,
                   help="reference log-probabilities kept per token, the rest as one bucket (default: %(default)s)")
    served = p.add_argument_group("a served model (--model endpoint:…)")
    served.add_argument("--local", default="default", metavar="MODEL",
                        help="the served model's model here: its tokenizer reads the text, and --reference is its "
                             "precision (default: %(default)s)")
    served.add_argument("--served-top-k", type=int, default=20, metavar="K",
                        help="likeliest tokens asked of the server per token (1-20, default: %(default)s; vLLM allows "
                             "20 unless started with --max-logprobs)")
    served.add_argument("--concurrency", type=int, default=4, help="chunks sent at once (default: %(default)s)")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--no-history", action="store_true", help="don't add the run to the history")


class _Progress:
    def __init__(self, what: str) -> None:
        self.what = what

    def __call__(self, p) -> None:
        eta = f", {p.eta_s:,.0f} s left" if p.eta_s is not None else ""
        print(f"\r  {self.what}: chunk {p.chunks_done}/{p.chunks} · {p.tokens_per_s:,.0f} tok/s{eta}   ",
              end="" if p.chunks_done < p.chunks else "\n", file=sys.stderr, flush=True)


def run(args, load_printer) -> int:
    from engine.base.cancel import CancelToken  # lazy: start-up
    from engine.endpoint import is_endpoint  # lazy: start-up
    from engine.measure import quality  # lazy: start-up
    from engine.models.loading import LoadRequest, load_model  # lazy: start-up

    served = is_endpoint(args.model)
    if args.reference == args.precision and args.kv_dtype == "auto" and not served:
        raise InvalidRequestError("--reference is the precision measured: pick another (fp32 is the usual one), or "
                                  "measure another KV-cache dtype (--kv-dtype) against it.")
    if is_endpoint(args.local):
        raise InvalidRequestError("--local: a model here (its tokenizer reads the text), not a served one.")
    name, text = quality.read_text(args.text)
    cancel = CancelToken()

    def load(model: str, precision: str, kv_dtype: str = "auto"):
        kv = "" if kv_dtype == "auto" else f", {kv_dtype} KV cache"
        print(f"Loading {model} ({precision}{kv}) …", file=sys.stderr, flush=True)
        return load_model(LoadRequest(model=model, precision=precision, device=args.device, kv_dtype=kv_dtype),
                          progress=load_printer, cancel=cancel)

    if served:
        return _served(args, load, text, name, cancel)
    reference = None
    try:
        if args.reference_file is not None:
            reference = quality.Reference.load(args.reference_file)
        elif args.reference is not None:
            reference = _reference(args, args.model, lambda: (load(args.model, args.reference), True), text, name,
                                   cancel)
        loaded = load(args.model, args.precision, args.kv_dtype)
        tokens = quality.text_tokens(loaded, text)
        report, kept = quality.measure(loaded, tokens, name, args.ctx, args.chunks, reference, args.top_k, args.batch,
                                       cancel, _Progress(args.precision))
    except KeyboardInterrupt:
        cancel.cancel()
        raise
    if args.save_reference is not None:
        print(f"reference {kept.save(args.save_reference)}")
    _report(args, loaded.info, report, reference)
    loaded.close()
    return 0


def _report(args, info, report, reference) -> None:
    """Keep the run in the history, print it, write its JSON."""
    import json

    from engine.measure import quality  # lazy: start-up

    if not args.no_history:
        quality.record(info, report)
    print(summary(report, reference))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.to_dict(), indent=2), encoding="utf-8")
        print(f"report   {args.json}")


def _served(args, load, text: str, name: str, cancel) -> int:
    """A served model's figures from the prompt log-probabilities its server returns, the text
    tokenized (and the reference kept) by ``--local``, the same model here."""
    from engine.endpoint import connect, parse_endpoint  # lazy: start-up
    from engine.measure import quality  # lazy: start-up
    from engine.measure.served_quality import measure_served  # lazy: start-up

    if args.save_reference is not None:
        raise InvalidRequestError("--save-reference keeps a model's whole distributions; a server sends only its top "
                                  "few. Save the reference from the model here (--model LOCAL).")
    spec = parse_endpoint(args.model)
    print(f"Connecting to {spec.url} …", file=sys.stderr, flush=True)
    endpoint = connect(spec, cancel=cancel)
    try:
        local = load(args.local, args.reference or "fp32")
        try:
            reference = None
            if args.reference_file is not None:
                reference = quality.Reference.load(args.reference_file)
            elif args.reference is not None:
                reference = _reference(args, args.local, lambda: (local, False), text, name, cancel)
            tokens = quality.text_tokens(local, text)
            report = measure_served(endpoint, tokens, local.token_text, quality.adds_bos(local.tokenizer), name,
                                    args.ctx, args.chunks, reference, args.served_top_k, args.concurrency, cancel,
                                    _Progress(f"{endpoint.info.name} at {spec.url}"))
        except KeyboardInterrupt:
            cancel.cancel()
            raise
        finally:
            local.close()
        _report(args, endpoint.info, report, reference)
    finally:
        endpoint.close()
    return 0


def _reference(args, model: str, get_model, text: str, name: str, cancel):
    """The reference precision's kept distributions: from the cache (no model loaded), or
    measured now with ``get_model()``'s (model, whether to close it), then kept."""
    from engine.measure import quality  # lazy: start-up

    path = quality.reference_path(model, args.reference, text, args.ctx, args.chunks, args.top_k)
    if path.exists():
        try:
            kept = quality.Reference.load(path)
            print(f"  reference: {args.reference}, kept from an earlier run ({path})", file=sys.stderr)
            return kept
        except InvalidRequestError:
            pass  # damaged: measure again
    reference, owned = get_model()
    try:
        tokens = quality.text_tokens(reference, text)
        report, kept = quality.measure(reference, tokens, name, args.ctx, args.chunks, None, args.top_k, args.batch,
                                       cancel, _Progress(f"reference {args.reference}"))
        kept.save(path)
        if not args.no_history:
            quality.record(reference.info, report)
        print(f"  reference: {args.reference}, PPL {report.perplexity:.4f}, {report.seconds:.1f} s (kept in {path})",
              file=sys.stderr)
        return kept
    finally:
        if owned:
            reference.close()


def summary(report, reference=None) -> str:
    from engine.base.units import format_bytes, kv_dtype_label  # lazy: start-up

    lines = [
        f"model     {report.model} · {report.precision} · {report.device}"
        + (f" · weights {format_bytes(report.weights_bytes)}" if report.weights_bytes else "")
        + (f" · KV cache {kv_dtype_label(report.kv_dtype)}" if report.kv_dtype else ""),
        f"text      {report.text} · {report.chunks} chunks × {report.ctx} tokens · {report.tokens_scored:,} scored",
        f"PPL       {report.perplexity:.4f} ± {report.perplexity_err:.4f}",
        f"time      {report.seconds:.1f} s ({report.tokens_per_s:,.0f} tok/s read)",
    ]
    d = report.divergence
    if d is not None:
        how = "every probability" if d.top_k == 0 else f"its top {d.top_k} and the rest as one bucket"
        if d.served_top_k is not None:
            how = (f"the server's top {d.served_top_k} found in the reference's top {d.top_k or 'all'}, the rest as "
                   "one bucket: a lower bound")
        lines += [
            f"against {d.reference} (KL over {how}):",
            f"  PPL ratio          {d.ppl_ratio:.4f}",
            f"  Cor(ln PPL)        {100 * d.ln_ppl_correlation:.2f}%",
            f"  Mean KLD           {d.kld_mean:.6f} ± {d.kld_mean_err:.6f}",
            f"  KLD median/90/95   {d.kld_median:.6f} / {d.kld_p90:.6f} / {d.kld_p95:.6f}",
            f"  KLD 99/99.9/max    {d.kld_p99:.6f} / {d.kld_p999:.6f} / {d.kld_max:.6f}",
            f"  Same top           {100 * d.same_top:.2f} ± {100 * d.same_top_err:.2f}%",
            f"  Mean Δp            {100 * d.dp_mean:+.3f} ± {100 * d.dp_mean_err:.3f}%",
            f"  RMS Δp             {100 * d.dp_rms:.3f}%",
            f"  Δp 1% / 99%        {100 * d.dp_p1:+.3f}% / {100 * d.dp_p99:+.3f}%",
            f"  Δp min / max       {100 * d.dp_min:+.3f}% / {100 * d.dp_max:+.3f}%",
        ]
    return "\n".join(lines)
