"""Quantization's price in quality: perplexity over a text and the KL divergence of every token's
distribution from a reference precision's, measured as llama.cpp's ``llama-perplexity`` measures
them (``--kl-divergence``), so the figures compare with the ones quantizers publish.

The method, as llama.cpp's ``perplexity.cpp``:

- the text is tokenized once (with the beginning-of-sequence token first where the tokenizer adds
  one), then cut into ``len // ctx`` chunks of ``ctx`` tokens (``--chunks`` takes the first N);
- each chunk is read from position 0 with no cache; where the tokenizer adds a BOS, the chunk's
  first token is replaced by it;
- only the second half of a chunk is scored: the tokens at ``ctx/2 + 1 … ctx − 1``, each given
  everything before it in its chunk (``ctx − 1 − ctx/2`` tokens a chunk), so every scored token
  sees at least half a context;
- perplexity is ``exp`` of the mean negative log-likelihood; its ± is the standard error carried
  through ``exp``; KL divergence is ``Σ p_ref · (log p_ref − log p)`` per token, with the mean
  (± its standard error), percentiles, the share of tokens whose top choice is the reference's,
  and Δp (this precision's probability of the text's token minus the reference's).

The reference's distributions are kept as their top ``k`` log-probabilities plus the rest's
mass (llama.cpp keeps every logit, 2 bytes each: 98 KB a token for a 49k vocabulary, 1.4 GB for
the default text): KL is then summed over the reference's top ``k`` with the rest as one bucket,
which by the log-sum inequality can only lower it. ``benchmarks/quality.py`` measures how much
against the exact sum (both models side by side).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from engine.base.cancel import CancelToken
from engine.base.errors import CancelledError, EngineError, InvalidRequestError
from engine.storage.history import RunRecord, _model_fields, save
from engine.storage.paths import cache_dir, resource_dir

DEFAULT_CTX = 512
TOP_K = 512
"""Reference log-probabilities kept per scored token (with the rest's mass)."""
BATCH_BYTES = 256 * 2**20
"""Chunks go through the model together while their scored logits (fp32) stay under this."""
DEFAULT_TEXT = "quality-text.txt"
"""In resources/: the evaluation text shipped (see resources/quality-text.md)."""


@dataclass(frozen=True)
class QualityProgress:
    """A chunk batch done: how far, how fast, how long is left."""

    chunks_done: int
    chunks: int
    tokens_per_s: float
    eta_s: float | None

    @classmethod
    def since(cls, started: float, done: int, chunks: int, ctx: int) -> "QualityProgress":
        """``done`` of ``chunks`` chunks of ``ctx`` tokens read since ``started`` (perf_counter)."""
        elapsed = time.perf_counter() - started
        rate = done * ctx / elapsed if elapsed > 0 else 0.0
        return cls(done, chunks, rate, (chunks - done) * ctx / rate if rate else None)


@dataclass
class Reference:
    """What a reference run keeps for another precision's KL divergence, per scored token: its
    top ``k`` log-probabilities and their ids, and the log-probability of the text's token."""

    model: str
    precision: str
    ctx: int
    tokens_sha: str
    """The scored text's token ids, hashed: a reference only serves the same tokens."""
    top_ids: np.ndarray  # [n, k] int32
    top_logprobs: np.ndarray  # [n, k] float32
    token_logprobs: np.ndarray  # [n] float32
    perplexity: float

    @property
    def k(self) -> int:
        return int(self.top_ids.shape[1])

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as out:
            np.savez_compressed(out, top_ids=self.top_ids, top_logprobs=self.top_logprobs,
                                token_logprobs=self.token_logprobs,
                                meta=np.array([self.model, self.precision, str(self.ctx), self.tokens_sha,
                                               repr(self.perplexity)]))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Reference":
        try:
            with np.load(Path(path)) as data:
                model, precision, ctx, sha, ppl = (str(v) for v in data["meta"])
                return cls(model, precision, int(ctx), sha, data["top_ids"], data["top_logprobs"],
                           data["token_logprobs"], float(ppl))
        except (OSError, KeyError, ValueError) as exc:
            raise InvalidRequestError(f"{path}: not a reference file this tool wrote ({exc}).") from exc


@dataclass(frozen=True)
class Divergence:
    """This precision against the reference, llama.cpp's ``--kl-divergence`` figures."""

    reference: str
    """The reference's precision."""
    top_k: int
    """Reference log-probabilities summed (the rest as one bucket); 0: every one (exact)."""
    kld_mean: float
    kld_mean_err: float
    kld_median: float
    kld_p90: float
    kld_p95: float
    kld_p99: float
    kld_p999: float
    kld_max: float
    same_top: float
    """Share of tokens whose likeliest next token is the reference's (of tied tokens, the lowest
    id: the one greedy decoding picks)."""
    same_top_err: float
    dp_mean: float
    """Mean of p(text's token) here minus under the reference."""
    dp_mean_err: float
    dp_rms: float
    dp_p1: float
    dp_p99: float
    dp_min: float
    dp_max: float
    ppl_ratio: float
    """This perplexity over the reference's."""
    ln_ppl_correlation: float
    """Pearson correlation of the tokens' −log p here and under the reference."""
    served_top_k: int | None = None
    """A served model (engine/measure/served_quality.py): the likeliest tokens the server sent per
    token; the KL divergence is then summed over those of them the reference's list holds, the rest
    as one bucket: a lower bound."""


@dataclass(frozen=True)
class QualityReport:
    model: str
    precision: str
    device: str
    text: str
    ctx: int
    chunks: int
    tokens_scored: int
    perplexity: float
    perplexity_err: float
    seconds: float
    tokens_per_s: float
    """Tokens read (all of each chunk, not only the scored half) per second."""
    weights_bytes: int | None
    divergence: Divergence | None = None
    token_kld: tuple[float, ...] = field(default=(), repr=False)
    """Each scored token's KL divergence, in order (the window colours the text by it)."""
    scored_ids: tuple[int, ...] = field(default=(), repr=False)
    """The scored tokens' ids, in order."""
    kv_dtype: str = ""
    """What the KV cache kept keys and values in (a torch dtype's name, or ``int8``: q8_0 blocks)."""

    def to_dict(self, per_token: bool = False) -> dict:
        out = asdict(self)
        if not per_token:
            out.pop("token_kld")
            out.pop("scored_ids")
        return out


def default_text_path() -> Path:
    return resource_dir() / DEFAULT_TEXT


def read_text(path: str | Path | None) -> tuple[str, str]:
    """(name, text) of an evaluation text: ``path`` (any UTF-8 file) or the shipped one."""
    target = Path(path) if path else default_text_path()
    try:
        return target.name, target.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise InvalidRequestError(f"No text file at {target}.") from exc
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"{target} is not UTF-8 text ({exc.reason} at byte {exc.start}).") from exc
    except OSError as exc:
        raise InvalidRequestError(f"Could not read {target}: {exc.strerror or exc}.") from exc


def adds_bos(tokenizer) -> int | None:
    """The BOS id where the tokenizer puts one before a text (llama.cpp's ``add_bos``), else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos if ids and ids[0] == bos else None


def text_tokens(loaded, text: str) -> list[int]:
    """The whole text's ids as llama.cpp reads it: the BOS first where the tokenizer adds one."""
    tokenizer = loaded.tokenizer
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = adds_bos(tokenizer)
    return ([bos] if bos is not None else []) + list(ids)


def plan_chunks(count: int, ctx: int, chunks: int | None) -> int:
    if ctx < 4 or ctx % 2:
        raise InvalidRequestError(f"--ctx {ctx}: an even number of tokens, at least 4.")
    available = count // ctx
    if available < 1:
        raise InvalidRequestError(f"The text has {count:,} tokens: fewer than one chunk of {ctx}; use a longer "
                                  "text or a smaller --ctx.")
    if chunks is not None and chunks < 1:
        raise InvalidRequestError("--chunks: at least 1.")
    return available if chunks is None else min(chunks, available)


def tokens_sha(tokens: Sequence[int], ctx: int, chunks: int) -> str:
    data = np.asarray(tokens[:ctx * chunks], dtype=np.int64).tobytes() + f"|{ctx}".encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _chunk_logprobs(loaded, ids, keep: int):
    """log-softmax (fp32) of the logits at the last ``keep`` positions but the final one, for a
    batch of chunks read from position 0: [batch, keep − 1, vocab]."""
    import torch

    with torch.inference_mode():
        if loaded.fast is not None:
            from engine.models.fast import chunk_logits  # lazy: it imports torch, which --help never needs

            logits = chunk_logits(loaded.fast, ids, keep)
        elif loaded.supports_logits_to_keep:
            logits = loaded.model(input_ids=ids, logits_to_keep=keep, use_cache=False).logits
        else:
            logits = loaded.model(input_ids=ids, use_cache=False).logits[:, -keep:]
        return torch.log_softmax(logits[:, :-1].float(), dim=-1)


def measure(loaded, tokens: Sequence[int], text_name: str = "", ctx: int = DEFAULT_CTX, chunks: int | None = None,
            reference: "Reference | object | None" = None, top_k: int = TOP_K, batch: int | None = None,
            cancel: CancelToken | None = None,
            on_progress: Callable[[QualityProgress], None] | None = None) -> tuple[QualityReport, Reference]:
    """Perplexity of ``loaded`` over ``tokens`` (and its divergence from ``reference``: a
    :class:`Reference` of the same tokens, or another loaded model for the exact sum), and what
    this run keeps as a reference for others."""
    import torch

    chunks = plan_chunks(len(tokens), ctx, chunks)
    sha = tokens_sha(tokens, ctx, chunks)
    exact = reference is not None and not isinstance(reference, Reference)
    if isinstance(reference, Reference) and (reference.tokens_sha != sha or reference.ctx != ctx):
        raise InvalidRequestError(f"The reference ({reference.model} {reference.precision}) scored other tokens "
                                  "(another text, model, --ctx or --chunks): make it again with these.")
    first = ctx // 2
    scored = ctx - 1 - first
    vocab = loaded.vocab_size or 1
    if batch is None:
        batch = max(1, min(16, BATCH_BYTES // max(1, scored * vocab * 4)))
    k = max(1, min(top_k, vocab))
    bos = adds_bos(loaded.tokenizer)
    device = loaded.device
    data = torch.tensor(list(tokens[:ctx * chunks]), dtype=torch.long).view(chunks, ctx)
    kept_ids = np.empty((chunks * scored, k), dtype=np.int32)
    kept_lp = np.empty((chunks * scored, k), dtype=np.float32)
    token_lp = np.empty(chunks * scored, dtype=np.float32)
    kld = np.empty(chunks * scored, dtype=np.float64) if reference is not None else None
    if exact:  # filled as the reference model reads each batch
        ref_token_lp = np.empty(chunks * scored, dtype=np.float32)
        ref_argmax = np.empty(chunks * scored, dtype=np.int64)
    elif reference is not None:  # the kept reference has them for these very tokens (checked above)
        ref_token_lp, ref_argmax = reference.token_logprobs, reference.top_ids[:, 0]
    started = time.perf_counter()
    for begin in range(0, chunks, batch):
        if cancel is not None and cancel.cancelled:
            raise CancelledError("Perplexity stopped.")
        rows = data[begin:begin + batch]
        targets = rows[:, first + 1:]
        inputs = rows.clone()
        if bos is not None:
            inputs[:, 0] = bos
        inputs = inputs.to(device)
        lp = _chunk_logprobs(loaded, inputs, ctx - first)  # [b, scored, vocab]
        if not torch.isfinite(lp).all():
            raise EngineError(f"{loaded.info.precision} gave non-finite scores in chunk {begin + 1}: no perplexity.")
        picked = lp.gather(-1, targets.to(lp.device).unsqueeze(-1)).squeeze(-1)
        top_lp, top_ids = _topk(lp, k)
        span = slice(begin * scored, (begin + len(rows)) * scored)
        token_lp[span] = picked.reshape(-1).cpu().numpy()
        kept_ids[span] = top_ids.reshape(-1, k).cpu().numpy()
        kept_lp[span] = top_lp.reshape(-1, k).cpu().numpy()
        if exact:
            ref_lp = _chunk_logprobs(reference, inputs.to(reference.device), ctx - first).to(lp.device)
            kld[span] = (ref_lp.exp() * (ref_lp - lp)).sum(-1).double().reshape(-1).cpu().numpy()
            ref_token_lp[span] = ref_lp.gather(-1, targets.to(lp.device).unsqueeze(-1)).reshape(-1).cpu().numpy()
            ref_argmax[span] = ref_lp.argmax(-1).reshape(-1).cpu().numpy()  # the first of tied tokens, as topk's
            del ref_lp
        elif reference is not None:
            ids = torch.from_numpy(reference.top_ids[span].astype(np.int64)).view(len(rows), scored, -1)
            p_lp = torch.from_numpy(reference.top_logprobs[span]).view(len(rows), scored, -1).to(lp.device)
            q_lp = lp.gather(-1, ids.to(lp.device))
            p = p_lp.exp()
            p_rest = (1 - p.sum(-1)).clamp_min(0)
            q_rest = (1 - q_lp.exp().sum(-1)).clamp_min(1e-30)
            rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-30).log() - q_rest.log()), 0.0)
            kld[span] = ((p * (p_lp - q_lp)).sum(-1) + rest).double().reshape(-1).cpu().numpy()
        del lp
        done = min(begin + batch, chunks)
        if on_progress is not None:
            on_progress(QualityProgress.since(started, done, chunks, ctx))
    seconds = time.perf_counter() - started
    nll = -token_lp.astype(np.float64)  # each scored token's −log p (fp32 scores, summed in fp64)
    mean = float(nll.mean())
    ppl = math.exp(mean)
    count = len(nll)
    ppl_err = ppl * _stderr(nll)
    divergence = None
    if reference is not None:
        divergence = _divergence(reference.info.precision if exact else reference.precision,
                                 0 if exact or reference.k >= vocab else reference.k,
                                 kld, token_lp, ref_token_lp, kept_ids[:, 0], ref_argmax, nll)
    info = loaded.info
    report = QualityReport(info.name, info.precision, info.device, text_name, ctx, chunks, count, ppl, ppl_err,
                           seconds, chunks * ctx / seconds if seconds > 0 else 0.0, info.weights_bytes, divergence,
                           tuple(kld.tolist()) if kld is not None else (),
                           tuple(int(t) for t in data[:, first + 1:].reshape(-1).tolist()), info.kv_dtype)
    kept = Reference(info.name, info.precision, ctx, sha, kept_ids, kept_lp, token_lp, ppl)
    return report, kept


def _topk(lp, k: int):
    """The ``k`` likeliest tokens, best first, the first being ``argmax``'s: of tokens tied at the
    top, the lowest id, as greedy decoding picks (``topk`` orders ties as its kernel happens to,
    which depends on the tensor's shape; with bf16 logits, ties at the top are common)."""
    import torch

    top_lp, top_ids = lp.topk(k, dim=-1)
    best = lp.argmax(-1, keepdim=True)
    where = (top_ids == best).to(torch.uint8).argmax(-1, keepdim=True)  # its place in the list (0 if absent)
    top_ids.scatter_(-1, where, top_ids[..., :1].clone())
    top_ids[..., :1] = best
    return top_lp, top_ids


def _stderr(values: np.ndarray) -> float:
    n = len(values)
    return float(np.std(values) / math.sqrt(n - 1)) if n > 1 else 0.0


def _divergence(reference: str, top_k: int, kld: np.ndarray, token_lp: np.ndarray, ref_token_lp: np.ndarray,
                argmax: np.ndarray, ref_argmax: np.ndarray, nll: np.ndarray) -> Divergence:
    kld = np.maximum(kld, 0.0)  # a few −1e-9 from rounding where the two agree
    same = (argmax == ref_argmax).astype(np.float64)
    p_same = float(same.mean())
    n = len(kld)
    dp = np.exp(token_lp.astype(np.float64)) - np.exp(ref_token_lp.astype(np.float64))
    ref_nll = -ref_token_lp.astype(np.float64)
    if np.std(nll) > 0 and np.std(ref_nll) > 0:
        correlation = float(np.corrcoef(nll, ref_nll)[0, 1])
    else:
        correlation = 1.0 if np.allclose(nll, ref_nll) else math.nan
    pct = lambda values, q: float(np.percentile(values, q))  # noqa: E731 - linear, as numpy's default
    return Divergence(
        reference=reference, top_k=top_k, kld_mean=float(kld.mean()), kld_mean_err=_stderr(kld),
        kld_median=pct(kld, 50), kld_p90=pct(kld, 90), kld_p95=pct(kld, 95), kld_p99=pct(kld, 99),
        kld_p999=pct(kld, 99.9), kld_max=float(kld.max()), same_top=p_same,
        same_top_err=math.sqrt(p_same * (1 - p_same) / (n - 1)) if n > 1 else 0.0,
        dp_mean=float(dp.mean()), dp_mean_err=_stderr(dp), dp_rms=float(np.sqrt(np.mean(dp ** 2))),
        dp_p1=pct(dp, 1), dp_p99=pct(dp, 99), dp_min=float(dp.min()), dp_max=float(dp.max()),
        ppl_ratio=math.exp(float(nll.mean()) - float(ref_nll.mean())), ln_ppl_correlation=correlation,
    )


def record(info, report: QualityReport) -> None:
    """Keep a run's figures in the history (kind ``quality``): the Cost explorer and the Compare
    window read them back; a history that can't be written never fails the run (it is logged)."""
    import logging


    try:
        save(RunRecord(kind="quality", **_model_fields(info), kv_cache_bytes=None, prompt_tokens=report.tokens_scored,
                       tokens=0, batch=1, decode_tokens_per_s=None, ttft_s=None, peak_memory_bytes=None,
                       extra={"quality": report.to_dict()}))
    except OSError as exc:
        logging.getLogger(__name__).warning("could not save the quality run to the history: %s", exc)


def reference_path(model_ref: str, precision: str, text: str, ctx: int, chunks: int | None, top_k: int) -> Path:
    """Where a reference precision's kept distributions wait for the next run (the user cache),
    found from what was asked, before any model loads (the file's token hash is checked when it
    is used)."""
    key = hashlib.sha256(f"{model_ref}|{precision}|{ctx}|{chunks}|{top_k}|{text}".encode()).hexdigest()[:20]
    return cache_dir() / "quality" / f"{precision}-{key}.npz"
