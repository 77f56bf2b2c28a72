"""Perplexity and KL divergence (engine/measure/quality.py), checked against sums done by hand on
a tiny model: the chunking, the scored half, the reference kept as top-k plus the rest."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from engine.base.errors import InvalidRequestError
from engine.measure import quality

CTX = 16
TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity. ") * 3


@pytest.fixture(scope="module")
def tokens(loaded_llama):
    return quality.text_tokens(loaded_llama, TEXT)


@pytest.fixture(scope="module")
def perturbed(tiny_llama):
    """The tiny llama again, its output head nudged: another model on the same tokens."""
    from engine.models.loading import LoadRequest, load_model

    loaded = load_model(LoadRequest(str(tiny_llama), "fp32", "cpu"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        head = loaded.model.get_output_embeddings().weight
        head.add_(0.05 * torch.randn(head.shape, generator=generator))
    yield loaded
    loaded.close()


def scored(reference, other, tokens, chunks):
    """For every scored token: both models' next-token distributions (plain softmaxes over whole
    chunks read alone) and the text's token."""
    first = CTX // 2
    for c in range(chunks):
        ids = torch.tensor([tokens[c * CTX:(c + 1) * CTX]])
        with torch.no_grad():
            p = torch.softmax(reference.model(input_ids=ids).logits[0].double(), -1)
            q = torch.softmax(other.model(input_ids=ids).logits[0].double(), -1)
        for j in range(first, CTX - 1):
            yield p[j], q[j], tokens[c * CTX + j + 1]


def by_hand(reference, other, tokens, chunks):
    """KL(p_ref ‖ p_other) and −log p_other(token) for every scored token."""
    klds, nlls = [], []
    for p, q, token in scored(reference, other, tokens, chunks):
        klds.append(float((p * (p.log() - q.log())).sum()))
        nlls.append(-math.log(float(q[token])))
    return np.array(klds), np.array(nlls)


def test_the_same_weights_give_zero_divergence_and_the_same_perplexity(loaded_llama, tokens):
    report, kept = quality.measure(loaded_llama, tokens, "dickens", CTX)
    chunks = len(tokens) // CTX
    assert report.chunks == chunks and report.tokens_scored == chunks * (CTX - 1 - CTX // 2)
    again, _ = quality.measure(loaded_llama, tokens, "dickens", CTX, reference=kept)
    d = again.divergence
    assert again.perplexity == report.perplexity
    assert d.kld_mean == pytest.approx(0, abs=1e-6) and d.kld_max == pytest.approx(0, abs=1e-5)
    assert d.same_top == 1.0 and d.ppl_ratio == pytest.approx(1.0) and d.dp_rms == pytest.approx(0, abs=1e-7)
    exact, _ = quality.measure(loaded_llama, tokens, "dickens", CTX, reference=loaded_llama)
    assert exact.divergence.top_k == 0 and exact.divergence.kld_mean == pytest.approx(0, abs=1e-6)


def test_a_perturbed_copy_gives_the_divergence_summed_by_hand(loaded_llama, perturbed, tokens):
    chunks = 3
    klds, nlls = by_hand(loaded_llama, perturbed, tokens, chunks)
    assert klds.mean() > 1e-4  # the nudge shows
    vocab = loaded_llama.vocab_size
    # every probability kept: the reference file gives the exact sum
    _, kept = quality.measure(loaded_llama, tokens, "", CTX, chunks, top_k=vocab)
    report, _ = quality.measure(perturbed, tokens, "", CTX, chunks, reference=kept)
    assert report.perplexity == pytest.approx(math.exp(nlls.mean()), rel=1e-5)
    assert report.divergence.kld_mean == pytest.approx(klds.mean(), rel=1e-4)
    assert report.divergence.kld_max == pytest.approx(klds.max(), rel=1e-4)
    assert np.allclose(report.token_kld, klds, rtol=1e-3, atol=1e-7)
    # both models side by side: the same exact sum
    exact, _ = quality.measure(perturbed, tokens, "", CTX, chunks, reference=loaded_llama)
    assert exact.divergence.kld_mean == pytest.approx(klds.mean(), rel=1e-4)
    # top 4 and the rest as one bucket: a lower bound, close to it
    _, top4 = quality.measure(loaded_llama, tokens, "", CTX, chunks, top_k=4)
    rough, _ = quality.measure(perturbed, tokens, "", CTX, chunks, reference=top4)
    assert rough.divergence.top_k == 4
    assert 0 < rough.divergence.kld_mean <= klds.mean() * (1 + 1e-6)
    assert np.all(np.array(rough.token_kld) <= klds * (1 + 1e-4) + 1e-9)
    # Δp: this model's probability of the text's token minus the reference's
    p_ref = np.exp(-by_hand(loaded_llama, loaded_llama, tokens, chunks)[1])
    assert report.divergence.dp_mean == pytest.approx(float((np.exp(-nlls) - p_ref).mean()), abs=1e-6)


def test_the_fast_path_scores_as_the_reference_does(tiny_llama, loaded_llama, tokens):
    from engine.models.loading import LoadRequest, load_model

    fast = load_model(LoadRequest(str(tiny_llama), "fp32-fast", "cpu"))
    try:
        assert fast.fast is not None
        _, kept = quality.measure(loaded_llama, tokens, "", CTX, 3)
        report, _ = quality.measure(fast, tokens, "", CTX, 3, reference=kept)
    finally:
        fast.close()
    assert report.divergence.kld_mean == pytest.approx(0, abs=1e-5) and report.divergence.same_top == 1.0
    assert report.divergence.ppl_ratio == pytest.approx(1.0, rel=1e-4)


def test_bad_inputs_are_refused_with_a_reason(loaded_llama, tokens, tmp_path):
    with pytest.raises(InvalidRequestError, match="fewer than one chunk"):
        quality.measure(loaded_llama, tokens[:CTX - 1], "", CTX)
    with pytest.raises(InvalidRequestError, match="even number"):
        quality.measure(loaded_llama, tokens, "", 15)
    _, kept = quality.measure(loaded_llama, tokens, "", CTX, 2)
    with pytest.raises(InvalidRequestError, match="scored other tokens"):
        quality.measure(loaded_llama, tokens[1:], "", CTX, 2, reference=kept)
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(InvalidRequestError, match="not UTF-8"):
        quality.read_text(tmp_path / "latin1.txt")
    with pytest.raises(InvalidRequestError, match="No text file"):
        quality.read_text(tmp_path / "missing.txt")
    (tmp_path / "junk.npz").write_bytes(b"not a reference")
    with pytest.raises(InvalidRequestError, match="not a reference file"):
        quality.Reference.load(tmp_path / "junk.npz")


def test_the_shipped_text_is_long_enough_and_said_where_it_comes_from():
    name, text = quality.read_text(None)
    assert name == "quality-text.txt" and len(text) > 90_000
    notes = (quality.default_text_path().parent / "quality-text.md").read_text(encoding="utf-8")
    assert "public domain" in notes and "char-rnn" in notes


def test_the_command_line_keeps_the_reference_and_the_history(tiny_llama, tmp_path, isolated_cache, capsys):
    from engine.cli import main
    from engine.storage.history import load_all

    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    args = ["perplexity", "--model", str(tiny_llama), "--precision", "bf16", "--reference", "fp32", "--text",
            str(text), "--ctx", str(CTX), "--chunks", "3", "--json", str(tmp_path / "out.json")]
    assert main(args) == 0
    first = capsys.readouterr()
    assert "Mean KLD" in first.out and "Same top" in first.out and "reference: fp32, PPL" in first.err
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["precision"] == "bf16" and report["chunks"] == 3 and report["divergence"]["reference"] == "fp32"
    assert main(args) == 0  # the reference is kept: not measured again
    assert "kept from an earlier run" in capsys.readouterr().err
    kinds = [(r.kind, r.precision) for r in load_all()]
    assert kinds.count(("quality", "bf16")) == 2 and kinds.count(("quality", "fp32")) == 1
    assert main(["perplexity", "--model", str(tiny_llama), "--precision", "fp32", "--reference", "fp32"]) == 1
    assert "--reference is the precision measured" in capsys.readouterr().err


def test_a_cancel_stops_at_the_next_chunk_and_progress_has_an_eta(loaded_llama, tokens):
    from engine.base.cancel import CancelToken
    from engine.base.errors import CancelledError

    cancel, seen = CancelToken(), []

    def on_progress(p):
        seen.append(p)
        cancel.cancel()

    with pytest.raises(CancelledError):
        quality.measure(loaded_llama, tokens, "", CTX, batch=1, cancel=cancel, on_progress=on_progress)
    assert len(seen) == 1 and seen[0].chunks_done == 1 and seen[0].chunks == len(tokens) // CTX
    assert seen[0].eta_s is not None and seen[0].eta_s > 0 and seen[0].tokens_per_s > 0


# -- a served model, from the prompt log-probabilities its server returns ----------------------
def bounded_by_hand(reference, other, tokens, chunks, k):
    """Each scored token's KL(p_ref ‖ p_other) over what a server sends (its top ``k`` and the
    text's token), the rest of each distribution as one bucket."""
    out = []
    for p, q, token in scored(reference, other, tokens, chunks):
        s = torch.tensor(sorted(set(q.topk(k).indices.tolist()) | {token}))
        p_s, q_s = p[s], q[s]
        p_rest, q_rest = 1 - float(p_s.sum()), 1 - float(q_s.sum())
        out.append(float((p_s * (p_s.log() - q_s.log())).sum()) + p_rest * math.log(p_rest / q_rest))
    return np.array(out)


@pytest.fixture
def served(request):
    """Serve the model fixture named by the test's parameter; yields (endpoint, loaded)."""
    from engine.endpoint import connect, parse_endpoint
    from tests.serving import serve

    loaded = request.getfixturevalue(request.param)
    server = serve(loaded)
    endpoint = connect(parse_endpoint(server.url))
    yield endpoint, loaded
    endpoint.close()
    server.stop()


@pytest.mark.parametrize("served", ["loaded_llama"], indirect=True)
def test_a_served_copy_of_the_same_weights_scores_as_the_model_here(served, tokens):
    from engine.measure.served_quality import measure_served

    endpoint, loaded = served
    local, kept = quality.measure(loaded, tokens, "dickens", CTX, 3)
    report = measure_served(endpoint, tokens, loaded.token_text, quality.adds_bos(loaded.tokenizer), "dickens", CTX,
                            3, reference=kept)
    assert report.precision == "served" and report.tokens_scored == local.tokens_scored
    assert report.perplexity == pytest.approx(local.perplexity, rel=1e-5)
    d = report.divergence
    assert d.served_top_k == 20 and d.kld_max == pytest.approx(0, abs=1e-5) and d.same_top == 1.0
    assert d.dp_rms == pytest.approx(0, abs=1e-6)


@pytest.mark.parametrize("served", ["perturbed"], indirect=True)
def test_a_served_model_gives_the_bounded_divergence_summed_by_hand(served, loaded_llama, tokens):
    from engine.measure.served_quality import measure_served

    endpoint, perturbed = served
    chunks, k = 3, 5
    _, every = quality.measure(loaded_llama, tokens, "", CTX, chunks, top_k=loaded_llama.vocab_size)
    here, _ = quality.measure(perturbed, tokens, "", CTX, chunks, reference=every)
    report = measure_served(endpoint, tokens, loaded_llama.token_text, quality.adds_bos(loaded_llama.tokenizer), "",
                            CTX, chunks, reference=every, top_k=k, concurrency=2)
    # what needs only the text's token is exact: perplexity, Δp, the top choice
    assert report.perplexity == pytest.approx(here.perplexity, rel=1e-5)
    d, exact = report.divergence, here.divergence
    assert d.dp_mean == pytest.approx(exact.dp_mean, abs=1e-6) and d.same_top == exact.same_top
    # KL over the server's top k and the text's token, the rest as one bucket: a lower bound, by hand
    bounded = bounded_by_hand(loaded_llama, perturbed, tokens, chunks, k)
    assert np.allclose(report.token_kld, bounded, rtol=1e-3, atol=1e-7)
    assert 0 < d.kld_mean <= exact.kld_mean * (1 + 1e-6)
    assert np.all(np.array(report.token_kld) <= np.array(here.token_kld) * (1 + 1e-4) + 1e-9)


def test_a_server_without_prompt_logprobs_or_with_another_tokenizer_is_told(loaded_llama, tokens, tmp_path,
                                                                            sp_tokenizer):
    from engine.base.errors import EndpointError
    from engine.endpoint import connect, parse_endpoint
    from engine.measure.served_quality import measure_served
    from engine.models.loading import LoadRequest, load_model
    from tests.serving import ThirdPartyServer, serve
    from tests.tiny import build_model_folder

    bos = quality.adds_bos(loaded_llama.tokenizer)
    with ThirdPartyServer() as other:
        endpoint = connect(parse_endpoint(other.url))
        with pytest.raises(EndpointError, match="without prompt log-probabilities"):
            measure_served(endpoint, tokens, loaded_llama.token_text, bos, "", CTX, 2)
        endpoint.close()
    elsewhere = load_model(LoadRequest(str(build_model_folder(tmp_path / "sp", "llama", sp_tokenizer)), "fp32", "cpu"))
    server = serve(elsewhere)
    endpoint = connect(parse_endpoint(server.url))
    try:
        with pytest.raises(EndpointError, match="another tokenizer"):
            measure_served(endpoint, tokens, loaded_llama.token_text, bos, "", CTX, 2)
    finally:
        endpoint.close()
        server.stop()


def test_the_command_line_measures_a_served_model_against_a_reference_here(loaded_llama, tiny_llama, tmp_path,
                                                                           isolated_cache, capsys):
    from engine.cli import main
    from tests.serving import serve

    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    server = serve(loaded_llama)
    try:
        args = ["perplexity", "--model", f"endpoint:{server.url}", "--local", str(tiny_llama), "--reference", "fp32",
                "--text", str(text), "--ctx", str(CTX), "--chunks", "3", "--served-top-k", "8",
                "--json", str(tmp_path / "served.json")]
        assert main(args) == 0
    finally:
        server.stop()
    out = capsys.readouterr().out
    assert "served" in out and "lower bound" in out and "server's top 8" in out
    report = json.loads((tmp_path / "served.json").read_text())
    assert report["divergence"]["served_top_k"] == 8 and report["divergence"]["kld_max"] < 1e-5


def test_of_tokens_tied_at_the_top_the_lowest_id_comes_first_as_greedy_decoding_picks():
    lp = torch.tensor([[[0.5, 1.0, 0.9, 1.0, 0.2, 1.0]] * 3])
    for k in (3, 4, 6):
        values, ids = quality._topk(lp, k)
        assert ids[..., 0].eq(1).all() and ids[..., 0].eq(lp.argmax(-1)).all()
        assert all(sorted(row) == sorted(lp.topk(k).indices[0, 0].tolist()) for row in ids[0].tolist())
        assert torch.equal(lp.gather(-1, ids), values)  # the values still belong to their ids
