import pytest
import torch

from engine.base.errors import UnsupportedPrecisionError
from engine.estimates.estimate import config_for, count_parameters, weights_bytes
from engine.base.events import Finished, Prefilled, TokenGenerated
from engine.generation.compiled_step import compile_decoder, compile_in_background, stop_compiling
from engine.generation.paged_cache import PagedCache
from engine.models.fast import dense_op
from engine.models.loading import LoadRequest, load_model
from engine.models.quantize import Int4WeightOnlyLinear, Int8WeightOnlyLinear, quantize_linears
from engine.base.request import GenerationRequest
from engine.generation.generate import generate

PROMPT = "The quick brown fox 😀 jumps"


def run(loaded, request):
    events = list(generate(loaded, request))
    return events, events[-1]


@pytest.fixture(scope="module")
def long_models(tmp_path_factory, byte_tokenizer):
    """Tiny llama, qwen2 (with q/k/v biases), qwen3 (query/key norms), smollm3 (layers without the
    rotary embedding), phi3 (fused projections, partial rotary), gemma2 (soft-capped scores and
    logits, sliding-window and global layers), gemma3 (each kind of layer its own rotary base, four
    norms a layer) and mistral (a window in every layer) that read 2048 tokens."""
    from tests.tiny import build_model_folder

    root = tmp_path_factory.mktemp("long")
    return {arch: build_model_folder(root / arch, arch, byte_tokenizer, max_position_embeddings=2048)
            for arch in FAST_ARCHITECTURES}


FAST_ARCHITECTURES = ("llama", "qwen2", "qwen3", "smollm3", "phi3", "gemma2", "gemma3", "mistral")


@pytest.mark.parametrize("arch", FAST_ARCHITECTURES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("in_place", [False, True], ids=["copied", "in-place"])
def test_fast_path_gives_the_reference_tokens_and_events(long_models, arch, precision, in_place):
    """The fast path answers as transformers does. Its first prompt chunk attends as transformers'
    attention does; later chunks and eager decode steps read the block table with the kernels'
    attention (``in_place``: fp32 throughout, bf16 numerators as PyTorch's flash kernel rounds
    them) or, without the kernels, a copy of the blocks with the flash kernel (the reference's
    rounding exactly); with the kernels loaded, the eager decode steps' products are theirs
    (``dense_linear``: sums in another order, so a bf16 output may round one step apart). In bf16
    the answer with either may leave the reference's only where the reference nearly tied: its
    own rounding tips such ties either way."""
    from engine.models import kernels

    if in_place and not kernels.kernels():
        pytest.skip(f"the kernels' attention isn't available here: {kernels.unavailable()}")
    reference = load_model(LoadRequest(str(long_models[arch]), precision, "cpu"))
    fast = load_model(LoadRequest(str(long_models[arch]), f"{precision}-fast", "cpu"))
    fast.fast.rows_attention = in_place
    assert fast.fast is not None and reference.fast is None
    assert fast.info.kv_shared is True and reference.info.kv_shared is False  # the load says which shares blocks
    # 600 prompt tokens: prefill in two chunks, and the pool grows past its first blocks
    request = GenerationRequest(PROMPT * 24, mode="raw", max_new_tokens=30, ignore_eos=True)
    ref_events, ref_final = run(reference, request)
    fast_events, fast_final = run(fast, request)
    assert [type(e) for e in fast_events] == [type(e) for e in ref_events]
    ref_tokens = [e for e in ref_events if isinstance(e, TokenGenerated)]
    fast_tokens = [e for e in fast_events if isinstance(e, TokenGenerated)]
    apart = next((i for i, (a, b) in enumerate(zip(fast_final.token_ids, ref_final.token_ids)) if a != b), None)
    own_rounding = in_place or fast.fast.dense
    if precision == "bf16" and own_rounding and apart is not None:
        top = ref_tokens[apart].top_alternatives
        assert top[0].logprob - top[1].logprob < 0.1, apart
    else:
        assert apart is None
    same = slice(0, apart)
    # bf16: each path rounds its own way (the sliding-window models' decode steps part from the
    # reference's by up to 0.05 where their fp32 steps agree to 1e-5)
    tolerance = 1e-3 if precision == "fp32" else 0.1 if own_rounding else 5e-2 if fast.fast.windowed else 2e-2
    assert [t.logprob for t in fast_tokens[same]] == pytest.approx([t.logprob for t in ref_tokens[same]],
                                                                   abs=tolerance)
    # the reference path's cache holds the predicted bytes (a sliding window's last tokens only); the
    # fast path's pool whole blocks of them (read from its storage), in each layer at most one partly
    # filled and one taken for the next token (a window's first block partly before it)
    assert all(t.kv_cache_bytes == t.kv_cache_bytes_predicted for t in ref_tokens)
    layers = fast.model.config.num_hidden_layers
    block = 16 * fast.info.kv_bytes_per_token
    for event in [*fast_tokens, fast_final]:
        assert event.kv_cache_bytes % (block // layers) == 0
        assert event.kv_cache_bytes_predicted <= event.kv_cache_bytes < event.kv_cache_bytes_predicted + 2 * block
    assert ref_final.kv_cache_bytes == fast_final.kv_cache_bytes_predicted
    assert isinstance(fast_events[0], Prefilled) and isinstance(fast_final, Finished)


def test_fast_int8_and_int4_on_the_default_model(default_model_folder):
    from engine.measure.compare import teacher_forced_logprobs

    reference = load_model(LoadRequest("default", "fp32", "cpu"))
    request = GenerationRequest("Explain microservices in simple terms.", max_new_tokens=32)
    reference_events, expected = run(reference, request)
    chosen = [e for e in reference_events if isinstance(e, TokenGenerated)]
    prompt = reference.encode(request)
    baseline = teacher_forced_logprobs(reference, prompt, list(expected.token_ids))
    count = count_parameters(config_for("default"))
    for precision in ("int8-fast", "int4-fast"):
        loaded = load_model(LoadRequest("default", precision, "cpu"))
        _, final = run(loaded, request)
        # fp32's answer scored by the quantized model: close log-probabilities (nf4 is ~0.3-0.5 here;
        # int4 regrids weights that came from a Q4_1 GGUF, so it stays near bf16's ~0.02)
        scores = teacher_forced_logprobs(loaded, prompt, list(expected.token_ids))
        assert sum(abs(a - b) for a, b in zip(scores, baseline)) / len(baseline) < 0.1, precision
        # the weights as predicted from the config (all but the 256-byte rotary buffer)
        assert abs(loaded.info.weights_bytes - weights_bytes(count, precision)) <= 256
        # its greedy answer leaves fp32's only where fp32 itself nearly tied (here the first token:
        # 0.024 nats between its top two, which int8 activations, as llama.cpp's Q8_0, tip over)
        apart = next((i for i, (a, b) in enumerate(zip(final.token_ids, expected.token_ids)) if a != b), None)
        if apart is not None:
            top = chosen[apart].top_alternatives
            assert top[0].logprob - top[1].logprob < 0.1, (precision, apart)
    assert weights_bytes(count, "int4-fast") < weights_bytes(count, "int8-fast") < weights_bytes(count, "bf16")


def test_quantized_layers_match_the_dense_product():
    torch.manual_seed(0)
    with torch.inference_mode():
        for rows in (208, 9008):  # one block, and several (tall heads run in 4096-row blocks)
            linear = torch.nn.Linear(576, rows, bias=True)
            x = torch.randn(3, 576)
            reference = linear(x)
            scale = reference.abs().mean()
            int8 = Int8WeightOnlyLinear(linear)(x).float()
            int4 = Int4WeightOnlyLinear(linear)(x).float()
            assert (int8 - reference).abs().mean() < 0.02 * scale
            assert (int4 - reference).abs().mean() < 0.15 * scale
            assert (int8 - reference).abs().mean() < (int4 - reference).abs().mean()


def test_int4_layers_fuse_when_their_rows_fit_the_packing():
    """q/k/v (576, 192, 192 rows) fuse into one int4 layer whose rows are the parts' (exactly), and
    each part, now a view of the fused rows, still computes what it did; a part of 48 rows (the
    packing interleaves blocks of 64) is left apart."""
    from engine.models.quantize import fuse_rows

    torch.manual_seed(0)
    with torch.inference_mode():
        parts = [Int4WeightOnlyLinear(torch.nn.Linear(576, rows, bias=rows == 192)) for rows in (576, 192, 192)]
        x = torch.randn(2, 576)
        before = [p(x) for p in parts]
        fused = fuse_rows(parts)
        assert isinstance(fused, Int4WeightOnlyLinear)
        assert torch.equal(fused(x), torch.cat(before, dim=-1))
        assert all(torch.equal(p(x), b) for p, b in zip(parts, before))
        assert all(p.packed0.untyped_storage().data_ptr() == fused.packed0.untyped_storage().data_ptr() for p in parts)
        assert fuse_rows([Int4WeightOnlyLinear(torch.nn.Linear(576, rows)) for rows in (576, 48)]) is None


def test_int4_falls_back_to_int8_for_shapes_its_kernel_refuses(tiny_models):
    from engine.models import kernels
    from engine.models.quantize import Int4BlockLinear

    model = load_model(LoadRequest(str(tiny_models["llama"]), "fp32", "cpu")).model
    if kernels.kernels():  # blocks of 32 inputs: 100 inputs don't divide
        model.model.layers[0].mlp.down_proj = torch.nn.Linear(100, 64, bias=False)
        kind = Int4BlockLinear
    else:  # the weight-only int4 kernel: rows in multiples of 16
        model.model.layers[0].mlp.down_proj = torch.nn.Linear(128, 60, bias=False)
        kind = Int4WeightOnlyLinear
    quantize_linears(model, "int4")
    assert isinstance(model.model.layers[0].mlp.down_proj, Int8WeightOnlyLinear)
    assert isinstance(model.model.layers[0].mlp.up_proj, kind)


def test_unsupported_models_and_devices_are_refused_clearly(tiny_models):
    with pytest.raises(UnsupportedPrecisionError, match="fast path runs"):
        load_model(LoadRequest(str(tiny_models["gpt2"]), "int8-fast", "cpu"))
    from engine.models.precision import get_precision

    with pytest.raises(UnsupportedPrecisionError, match="CPU"):
        get_precision("int4-fast").check_device("cuda")


@pytest.mark.parametrize("arch", FAST_ARCHITECTURES)
@pytest.mark.parametrize("precision", ["fp32-fast", "int8-fast", "int4-fast"])
def test_fused_layers_leave_the_model_itself_working(long_models, arch, precision):
    """q/k/v and gate/up are fused for the fast path (engine/models/fast.py, here its paged cache), their
    weights turned into views of the fused ones; transformers' own forward (batching, speculation, teacher forcing use it) must
    still compute the same thing."""
    loaded = load_model(LoadRequest(str(long_models[arch]), precision, "cpu"))
    ids = torch.tensor([loaded.encode(GenerationRequest(PROMPT, mode="raw"))])
    # the cache in the dtype the layers compute in (the quantized precisions keep fp16: rounding
    # that transformers' forward, with no cache, doesn't do), so only the fusion could differ
    loaded.fast.kv_dtype = loaded.fast.dtype
    with torch.inference_mode():
        theirs = loaded.model(input_ids=ids).logits[0, -1].float()
        cache = PagedCache(loaded.fast)
        cache.add(0, ids.shape[1])
        ours = cache.prefill(0, ids).float()
    assert torch.allclose(ours, theirs, atol=2e-2 * float(theirs.abs().max()))
    assert int(ours.argmax()) == int(theirs.argmax())


def _greedy_alone(loaded, ids: list[int], steps: int) -> list[torch.Tensor]:
    """A sequence's scores decoded greedily alone, its pool big enough from the start."""
    cache = PagedCache(loaded.fast)
    cache.add(0, 256)
    out = [cache.prefill(0, torch.tensor([ids]))]
    for _ in range(steps):
        out.append(cache.decode([0], [int(out[-1].argmax())])[0])
    return out


def test_decoding_while_the_pool_grows_equals_a_pool_sized_up_front(long_models):
    """The pool's storage is new tensors each time it grows (two blocks at a time here), and the
    rotary tables double past 64 positions: a step must read the new ones. Two sequences decoded
    past 64 tokens, a third joining on the way, against each sequence alone."""
    loaded = load_model(LoadRequest(str(long_models["llama"]), "fp32-fast", "cpu"))
    prompts = [loaded.encode(GenerationRequest(p, mode="raw")) for p in (PROMPT, "a", PROMPT * 2)]

    with torch.inference_mode():
        cache = PagedCache(loaded.fast)
        cache.kv.pool.chunk = 2
        last: dict[int, torch.Tensor] = {}
        got: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
        for seq in (0, 1):
            cache.add(seq, len(prompts[seq]))
            last[seq] = cache.prefill(seq, torch.tensor([prompts[seq]]))
            got[seq].append(last[seq])
        for step in range(80):
            if step == 30:  # a third sequence joins
                cache.add(2, len(prompts[2]))
                last[2] = cache.prefill(2, torch.tensor([prompts[2]]))
                got[2].append(last[2])
            seqs = sorted(last)
            logits = cache.decode(seqs, [int(last[s].argmax()) for s in seqs])
            for seq, row in zip(seqs, logits):
                last[seq] = row
                got[seq].append(row)
        assert cache.rotary > 64 and cache.keys[0].shape[0] == cache.kv.pool.allocated > 2
        for seq, rows in got.items():
            for ours, theirs in zip(rows, _greedy_alone(loaded, prompts[seq], len(rows) - 1)):
                assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def test_sequences_leaving_in_any_order_leave_the_others_answers_as_alone(long_models):
    """A sequence that leaves gives its blocks back; the next one takes them again (the pool does
    not grow for it). Four sequences; the second and the last leave, a fifth joins, then all
    leave: every answer equals its sequence's alone, and nothing is left holding a block."""
    loaded = load_model(LoadRequest(str(long_models["llama"]), "fp32-fast", "cpu"))
    prompts = [loaded.encode(GenerationRequest(p, mode="raw")) for p in (PROMPT, "a", PROMPT * 2, "b c", "d")]

    with torch.inference_mode():
        cache = PagedCache(loaded.fast)
        last: dict[int, torch.Tensor] = {}
        got: dict[int, list[torch.Tensor]] = {seq: [] for seq in range(5)}

        def join(seq: int) -> None:
            cache.add(seq, len(prompts[seq]))
            last[seq] = cache.prefill(seq, torch.tensor([prompts[seq]]))
            got[seq].append(last[seq])

        def steps(n: int) -> None:
            for _ in range(n):
                seqs = sorted(last)
                for seq, row in zip(seqs, cache.decode(seqs, [int(last[s].argmax()) for s in seqs])):
                    last[seq] = row
                    got[seq].append(row)

        def leave(*seqs: int) -> None:
            for seq in seqs:
                cache.remove(seq)
                del last[seq]

        for seq in range(4):
            join(seq)
        steps(5)
        before = cache.kv.pool.allocated
        freed = len(cache.kv.tables[1]) + len(cache.kv.tables[3])
        leave(1, 3)
        assert len(cache) == 2 and len(cache.kv.pool.empty) >= freed
        steps(5)
        join(4)
        steps(5)
        assert cache.kv.pool.allocated == before  # the fifth took blocks the others gave back
        assert cache.kv.used_blocks == sum(len(t) for t in cache.kv.tables.values())
        leave(2, 0, 4)
        assert len(cache) == 0 and cache.kv.used_blocks == 0
        for seq in range(5):
            rows = got[seq]
            assert len(rows) > 1
            for ours, theirs in zip(rows, _greedy_alone(loaded, prompts[seq], len(rows) - 1)):
                assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rollback", [False, True], ids=["plain", "speculating"])
def test_sliding_window_layers_keep_only_their_windows_blocks(long_models, rollback):
    """Gemma 3's local layers (a 10-token window) keep only the blocks their window reads, in a pool
    of their own; the blocks behind it go back to that pool and the next sequence takes them. The
    bytes held, read from the tensors, stay within whole blocks of the config's prediction (window
    included); while guesses are verified, the windows keep the most a sequence is rolled back."""
    from engine.base.kv import kv_layout
    from engine.generation.proposer import MAX_DRAFT_TOKENS

    loaded = load_model(LoadRequest(str(long_models["gemma3"]), "fp32-fast", "cpu"))
    layout = kv_layout(loaded.model.config)
    window = max(w for w in layout.windows if w)
    per_layer = layout.bytes_per_token_per_layer(4) * 16  # a block of one layer
    windowed = sum(1 for w in layout.windows if w)
    prompt = loaded.encode(GenerationRequest(PROMPT * 40, mode="raw"))[:700]
    with torch.inference_mode():
        cache = PagedCache(loaded.fast)
        cache.rollback = rollback
        cache.add(0, len(prompt))
        logits = cache.prefill(0, torch.tensor([prompt]))
        for _ in range(40):
            logits = cache.decode([0], [int(logits.argmax())])[0]
        length = cache.length(0)
        start, read = cache.reading[0]
        reach = window - 1 + (MAX_DRAFT_TOKENS if rollback else 0)  # positions before the next token's
        assert len(read) <= -(-reach // 16) + 1 and read == cache.kv.tables[0][start:]
        assert set(cache.window_of) == set(read)  # nothing cached: the parts left behind went back
        measured = cache.kv_bytes(0)
        assert measured == len(cache.kv.tables[0]) * (layout.num_layers - windowed) * per_layer \
            + len(read) * windowed * per_layer == cache.held_nbytes()
        predicted = layout.bytes_for(length, 4)
        assert predicted <= measured < predicted + 2 * per_layer * layout.num_layers + windowed * reach * per_layer // 16
        assert cache.storage_nbytes() == sum(t.untyped_storage().nbytes() for t in cache.keys + cache.values)
        grown = cache.window_blocks
        cache.add(1, len(prompt))
        cache.prefill(1, torch.tensor([prompt]))
        assert cache.window_blocks == grown  # the second sequence's windows took blocks the first gave back
        cache.remove(0)
        cache.remove(1)
        assert len(cache.window_free) == cache.window_blocks and cache.held_nbytes() == 0


def test_a_long_request_among_short_ones_holds_only_its_own_blocks(long_models):
    """No rectangle: each sequence holds the blocks of its own tokens, whatever the longest
    holds, and the pool's storage is those blocks (read from its tensors)."""
    loaded = load_model(LoadRequest(str(long_models["llama"]), "fp32-fast", "cpu"))
    long = loaded.encode(GenerationRequest(PROMPT * 40, mode="raw"))[:700]
    short = loaded.encode(GenerationRequest("a b", mode="raw"))
    with torch.inference_mode():
        cache = PagedCache(loaded.fast)
        cache.kv.pool.chunk = 1
        for seq, ids in enumerate([long] + [short] * 15):
            cache.add(seq, len(ids))
            cache.prefill(seq, torch.tensor([ids]))
        cache.decode(list(range(16)), [1] * 16)
    tokens = len(long) + 1 + 15 * (len(short) + 1)
    blocks = cache.kv.blocks_for(len(long) + 1) + 15 * cache.kv.blocks_for(len(short) + 1)
    assert cache.kv.used_blocks == cache.kv.pool.allocated == blocks
    assert cache.storage_nbytes() == blocks * cache.block_nbytes()
    assert cache.block_nbytes() == 16 * cache.per_token_bytes
    assert blocks * 16 < 16 * (len(long) + 1)  # far below 16 rows of the longest
    assert blocks * 16 - tokens < 16 * 16  # at most a partly filled block each


def batched_answers(loaded, prompts: list[str], tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens, all decoded together through the engine core."""
    from engine.base.events import BatchFinished
    from engine.measure.batch import stream_batch

    request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=tokens, ignore_eos=True)
    ids = [loaded.encode(GenerationRequest(p, mode="raw")) for p in prompts]
    finished = [e for e in stream_batch(loaded, request, ids) if isinstance(e, BatchFinished)][0]
    return [list(s.token_ids) for s in finished.sequences]


def core_answers(loaded, requests: list[GenerationRequest]) -> list[tuple[int, ...]]:
    """Each request's tokens, all submitted at once to one engine core (a batched step's rows)."""
    from engine.generation.core import CoreSettings, EngineCore

    core = EngineCore(loaded, CoreSettings())
    ids = [core.submit(r) for r in requests]
    finals = {e.request_id: e.token_ids for e in core.run() if isinstance(e, Finished)}
    return [finals[rid] for rid in ids]


BATCH_PROMPTS = [PROMPT, "a", PROMPT * 3, "Once upon"]
"""Prompts of different lengths: each row of a batched step at its own position."""


def calls_op(package, op: str) -> bool:
    """Whether a compiled package's generated code calls the kernels' operator ``op``."""
    import zipfile

    names = (f"workbench::{op}".encode(), f"workbench.{op}".encode())
    with zipfile.ZipFile(package) as z:
        return any(name in z.read(info) for info in z.infolist() if info.filename.endswith((".cpp", ".json"))
                   for name in names)


def live_extractions() -> list[str]:
    """Files this process has mapped from a package loader's ``aotinductor_*`` folder that are still on disk."""
    from pathlib import Path

    paths = {line.split(maxsplit=5)[5].strip() for line in Path("/proc/self/maps").read_text().splitlines()
             if "aotinductor_" in line and len(line.split(maxsplit=5)) == 6}
    return [p for p in paths if not p.endswith("(deleted)") and Path(p).exists()]


KILLED_AFTER_LOADING = """
import os, signal, sys
import torch
from engine.generation.compiled_step import compile_decoder
from engine.models.loading import LoadRequest, load_model
torch.set_num_threads(int(sys.argv[2]))  # the parent's count (a test worker's may differ from a fresh process's)
loaded = load_model(LoadRequest(sys.argv[1], "fp32-fast", "cpu"))
report = compile_decoder(loaded.fast)
print("loaded" if report.error is None and not report.built and loaded.fast.compiled else report, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_compiled_decode_step_gives_the_same_tokens(long_models, isolated_cache, monkeypatch, tmp_path):
    """Built by a child process into the user cache, loaded here: the eager step's tokens, for
    every block table and pool size (dynamic dimensions of one build), at its own thread count
    only; a later load of the same weights loads the package instead of building it. The
    batched step beside it (where the int8 kernels are) gives the eager batched tokens, for any
    number of rows."""
    from engine.generation.compiled_step import CompileReport
    from engine.models import kernels

    # a fixed count: the build's process is "other load", after which the count would adapt
    monkeypatch.setenv("INFERENCE_WORKBENCH_THREADS", str(torch.get_num_threads()))
    loaded = load_model(LoadRequest(str(long_models["llama"]), "fp32-fast", "cpu"))
    request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=80, ignore_eos=True)
    long = GenerationRequest(PROMPT, mode="raw", max_new_tokens=300, ignore_eos=True)  # past 256 positions
    _, eager = run(loaded, request)
    _, eager_long = run(loaded, long)
    eager_batched = {n: batched_answers(loaded, BATCH_PROMPTS[:n], 20) for n in (2, 4)}
    reports: list[CompileReport] = []
    thread = compile_in_background(loaded.fast, reports.append)
    thread.join(timeout=900)
    report = reports[0]
    assert report.error is None and report.built and report.seconds > 0
    package = isolated_cache / "compiled"
    step_name = report.package.rsplit("/", 1)[-1]
    if kernels.kernels():
        assert report.rows_error is None and report.rows_built and loaded.fast.compiled_rows is not None
        rows_name = step_name.replace("step-", "rows-", 1)
        assert sorted(p.name for p in package.glob("*.pt2")) == sorted([rows_name, step_name])  # no partial file
        assert report.rows_bytes == (package / rows_name).stat().st_size > 0
        # a batch's fp32 products are the kernels' dense_linear wherever the eager steps' are;
        # one row's are Inductor's
        assert calls_op(package / rows_name, "dense_linear") == dense_op()
        assert not calls_op(package / step_name, "dense_linear")
        rows_calls = []
        compiled_rows = loaded.fast.compiled_rows
        loaded.fast.compiled_rows = lambda *a: rows_calls.append(a[5].shape[0]) or compiled_rows(*a)
        assert {n: batched_answers(loaded, BATCH_PROMPTS[:n], 20) for n in (2, 4)} == eager_batched
        assert 2 in rows_calls and 4 in rows_calls and min(rows_calls) >= 2  # one row: the one-sequence step
        # a draft's guesses are checked on the batched step too: the last token and its guesses as
        # one sequence's consecutive rows, the answer the eager step's
        from engine.generation.speculative import load_draft, parse_draft, stream_speculative

        rows_calls.clear()
        lookup = load_draft(parse_draft("ngram:1", "fp32-fast"), loaded)
        guessed = next(e for e in stream_speculative(loaded, lookup, request, 4) if isinstance(e, Finished))
        assert guessed.token_ids == eager.token_ids and guessed.drafted_tokens > 0 and rows_calls
        # an early-exit draft of a compiled model gets a compiled step of its own (its first layers)
        early = load_draft(parse_draft("early-exit:1", "fp32-fast"), loaded)
        early.fast._compile_thread.join(timeout=900)
        assert early.fast.compiled is not None and early.fast.compiled is not loaded.fast.compiled
        drafted = []
        own = early.fast.compiled
        early.fast.compiled = lambda *a: drafted.append(len(a[1])) or own(*a)  # the view's layers' caches
        guessed = next(e for e in stream_speculative(loaded, early, request, 3) if isinstance(e, Finished))
        assert guessed.token_ids == eager.token_ids and drafted and set(drafted) == {1}
        early.close()
    else:
        assert report.rows_error and loaded.fast.compiled_rows is None
        assert [p.name for p in package.glob("*.pt2")] == [step_name]
    assert report.package_bytes == (package / step_name).stat().st_size
    # the one-sequence step attends with the kernels wherever they load (its generated code
    # calls their operator), with the matmuls elsewhere: the same tokens either way (below)
    assert calls_op(package / step_name, "attend_paged") == kernels.kernels()
    calls = []
    compiled = loaded.fast.compiled
    loaded.fast.compiled = lambda *a: calls.append(a[7].shape[1]) or compiled(*a)  # the block table's width
    events, answer = run(loaded, request)
    assert answer.token_ids == eager.token_ids and len(set(calls)) > 1  # one build for every table
    tokens = [e for e in events if isinstance(e, TokenGenerated)]
    block = 16 * loaded.info.kv_bytes_per_token
    assert all(t.kv_cache_bytes_predicted <= t.kv_cache_bytes < t.kv_cache_bytes_predicted + 2 * block
               for t in tokens)
    assert [t.logprob for t in tokens] == pytest.approx([t.logprob for t in run(loaded, request)[0]
                                                         if isinstance(t, TokenGenerated)], abs=1e-5)
    calls.clear()
    assert run(loaded, long)[1].token_ids == eager_long.token_ids and max(calls) * 16 > 300  # the same build
    # built for this thread count: with another (the count adapts to the machine's load) its
    # generated code would still run the other count's threads, so the eager step runs instead
    assert loaded.fast.compiled_threads == torch.get_num_threads()
    before = torch.get_num_threads()
    try:
        calls.clear()
        torch.set_num_threads(before + 1)
        monkeypatch.setenv("INFERENCE_WORKBENCH_THREADS", str(before + 1))  # the adaptation keeps it
        _, other = run(loaded, GenerationRequest(PROMPT, mode="raw", max_new_tokens=3, ignore_eos=True))
        assert not calls and other.tokens == 3
    finally:
        torch.set_num_threads(before)
        monkeypatch.setenv("INFERENCE_WORKBENCH_THREADS", str(before))
    # the same weights loaded again: the package is loaded, not built
    again = load_model(LoadRequest(str(long_models["llama"]), "fp32-fast", "cpu"))
    cached = compile_decoder(again.fast)
    assert cached.error is None and not cached.built and not cached.rows_built and cached.package == report.package
    assert run(again, request)[1].token_ids == eager.token_ids
    # unloading gives the weights back: the runner holds none of the model's tensors (it had kept
    # every tensor handed to it, so each load and unload of a compiled model pinned its weights)
    import gc
    import weakref

    ours = {id(t) for m in again.fast.modules() for t in (*m._parameters.values(), *m._buffers.values())}
    handed = [weakref.ref(t) for t in again.fast.compiled.constants.values() if id(t) in ours]
    assert handed
    del again
    gc.collect()
    assert [ref for ref in handed if ref() is not None] == []
    # the loader's extraction folders are gone once loaded (it still runs, above), so a process
    # killed after loading leaves nothing in the temporary directory (it had left ~4 MB a package)
    import os
    import subprocess
    import sys

    if sys.platform.startswith("linux"):
        assert live_extractions() == []
        temp = tmp_path / "temp"
        temp.mkdir()
        killed = subprocess.run([sys.executable, "-c", KILLED_AFTER_LOADING, str(long_models["llama"]),
                                 str(torch.get_num_threads())],
                                env={**os.environ, "TMPDIR": str(temp)}, capture_output=True, text=True, timeout=300)
        assert killed.returncode == -9 and killed.stdout.strip() == "loaded", killed.stderr[-2000:]
        assert [p.name for p in temp.iterdir() if p.name.startswith("aotinductor_")] == []
    # a damaged package is refused, removed, and the eager step goes on
    with open(report.package, "r+b") as f:
        f.truncate(4096)
    third = load_model(LoadRequest(str(long_models["llama"]), "fp32-fast", "cpu"))
    damaged = compile_decoder(third.fast)
    assert damaged.error and third.fast.compiled is None and not (package / report.package.rsplit("/", 1)[-1]).exists()
    assert run(third, request)[1].token_ids == eager.token_ids


def test_a_package_built_from_other_weights_is_refused(long_models, isolated_cache):
    """The loader checks the weights' fingerprint the package was built from."""
    from engine.generation import compiled_step

    llama = load_model(LoadRequest(str(long_models["llama"]), "fp32-fast", "cpu"))
    qwen = load_model(LoadRequest(str(long_models["qwen2"]), "fp32-fast", "cpu"))
    assert compiled_step.fingerprint(llama.fast) != compiled_step.fingerprint(qwen.fast)
    assert compiled_step.fingerprint(llama.fast) == compiled_step.fingerprint(
        load_model(LoadRequest(str(long_models["llama"]), "fp32-fast", "cpu")).fast)
    assert compiled_step.package_path(llama.fast, 2) != compiled_step.package_path(qwen.fast, 2)
    assert compiled_step.package_path(llama.fast, 1) != compiled_step.package_path(llama.fast, 2)


def test_the_model_info_names_the_dtypes_its_decoder_runs(long_models, monkeypatch):
    """The int8 kernels expected here (the CPU has their flags) but not there when the layers were
    quantized (a failed compile): the layers multiply with PyTorch's weight-only kernels in bf16,
    and the info the window shows says bf16 for the activations and the cache, not the fp32 and
    fp16 that the kernels would have meant."""
    from engine.models import kernels

    monkeypatch.setattr(kernels, "expected", lambda: True)
    monkeypatch.setattr(kernels, "kernels", lambda: False)
    loaded = load_model(LoadRequest(str(long_models["llama"]), "int8-fast", "cpu"))
    assert loaded.fast.dtype == torch.bfloat16 and loaded.fast.kv_dtype == torch.bfloat16
    assert (loaded.info.compute_dtype, loaded.info.kv_dtype) == ("bfloat16", "bfloat16")
    per_element = loaded.info.kv_bytes_per_token // (2 * loaded.info.num_layers * loaded.info.num_kv_heads
                                                     * loaded.info.head_dim)
    assert per_element == 2
    assert PagedCache(loaded.fast).per_token_bytes == loaded.info.kv_bytes_per_token


def test_a_failed_build_leaves_the_eager_step(tmp_path, byte_tokenizer, isolated_cache):
    """The weights on disk changed after loading: the child process, which loads them again,
    refuses to build a step for other weights than the parent's, and says so."""
    from tests.tiny import build_model_folder

    folder = build_model_folder(tmp_path / "changing", "llama", byte_tokenizer, seed=1)
    loaded = load_model(LoadRequest(str(folder), "int8-fast", "cpu"))
    build_model_folder(folder, "llama", byte_tokenizer, seed=2)
    report = compile_decoder(loaded.fast)
    assert "changed since it was loaded" in report.error and not report.built
    assert loaded.fast.compiled is None and not list((isolated_cache / "compiled").glob("*.pt2"))
    _, final = run(loaded, GenerationRequest(PROMPT, mode="raw", max_new_tokens=5, ignore_eos=True))
    assert final.tokens == 5


def test_stopping_a_build_ends_its_process(long_models, isolated_cache):
    loaded = load_model(LoadRequest(str(long_models["qwen2"]), "fp32-fast", "cpu"))
    reports = []
    thread = compile_in_background(loaded.fast, reports.append)
    stop_compiling(loaded.fast, timeout=30)
    assert not thread.is_alive() and reports[0].error == "cancelled"
    assert loaded.fast.compiled is None and not list((isolated_cache / "compiled").glob("*.pt2"))
    import multiprocessing

    assert not [p for p in multiprocessing.active_children() if p.name == "fast-path-build"]


@pytest.mark.parametrize("precision", ["fp32-fast", "int8-fast"])
def test_a_compiled_step_with_a_head_in_row_blocks_gives_the_eager_tokens(tmp_path, byte_tokenizer, precision,
                                                                         isolated_cache):
    """A head taller than two row blocks (a 9,000-token vocabulary) is multiplied block by block;
    frozen into the compiled step with the C++ GEMM templates, blocks that were slices of one
    weight gave wrong logits (tied from the first token). The compiled step must agree with the
    eager one."""
    from engine.models.quantize import ROW_BLOCK
    from tests.tiny import build_model_folder

    folder = build_model_folder(tmp_path / "tall", "llama", byte_tokenizer, vocab_size=2 * ROW_BLOCK + 808)
    loaded = load_model(LoadRequest(str(folder), precision, "cpu"))
    request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=12, ignore_eos=True)
    events, eager = run(loaded, request)
    report = compile_decoder(loaded.fast, rows=False)
    assert report.error is None and report.built
    compiled_events, compiled = run(loaded, request)
    # fp32: the same tokens throughout; int8: the compiled step's attention is in fp32 where the eager
    # one's is in bf16, so on a random model a near-tie may later go the other way: its first step
    # (the one the slices broke at once) is checked
    checked = len(eager.token_ids) if precision == "fp32-fast" else 2
    assert compiled.token_ids[:checked] == eager.token_ids[:checked]
    eager_scores = [e.logprob for e in events if isinstance(e, TokenGenerated)][:checked]
    compiled_scores = [e.logprob for e in compiled_events if isinstance(e, TokenGenerated)][:checked]
    assert max(abs(a - b) for a, b in zip(eager_scores, compiled_scores)) < (5e-2 if precision == "fp32-fast" else 0.25)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_tied_head_in_row_blocks_keeps_one_copy_of_the_table(tmp_path, byte_tokenizer, precision, arch):
    """A head tied to the embedding (the default model's, Gemma's) and tall enough for row blocks:
    the embedding looks its rows up in the head's blocks, so the fast path's weights are the tied
    model's bytes, as predicted (the blocks as copies beside the table added its whole size); Gemma's
    embedding keeps its scale (√hidden size)."""
    from engine.models.quantize import ROW_BLOCK, BlockedDenseLinear, BlockedEmbedding
    from tests.tiny import build_model_folder

    folder = build_model_folder(tmp_path / "tied", arch, byte_tokenizer, vocab_size=2 * ROW_BLOCK + 808,
                                tie_word_embeddings=True, initializer_range=0.02)
    reference = load_model(LoadRequest(str(folder), precision, "cpu"))
    fast = load_model(LoadRequest(str(folder), f"{precision}-fast", "cpu"))
    head, embed = fast.model.get_output_embeddings(), fast.model.get_input_embeddings()
    assert isinstance(head, BlockedDenseLinear) and isinstance(embed, BlockedEmbedding)
    # one copy: the same memory (on huge pages each module holds its own view of it)
    assert all(getattr(embed, f"block{i}").data_ptr() == getattr(head, f"block{i}").data_ptr()
               for i in range(len(head.blocks)))
    predicted = weights_bytes(count_parameters(config_for(str(folder))), f"{precision}-fast")
    assert fast.info.weights_bytes == reference.info.weights_bytes
    buffers = sum(b.nbytes for b in reference.model.buffers())  # rotary frequencies (Gemma: the embedding's scale)
    assert 0 <= fast.info.weights_bytes - predicted <= buffers
    # every token id looks up its own row, across the blocks' edges
    ids = torch.tensor([[0, ROW_BLOCK - 1, ROW_BLOCK, 2 * ROW_BLOCK, 2 * ROW_BLOCK + 807]])
    with torch.inference_mode():
        expected = reference.model.get_input_embeddings()(ids).to(embed(ids).dtype)
        assert torch.equal(embed(ids), expected)
        for wrong in (-1, 2 * ROW_BLOCK + 808):  # refused as nn.Embedding refuses them, not clamped to another row
            with pytest.raises(IndexError):
                embed(torch.tensor([[3, wrong]]))
    request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=12, ignore_eos=True)
    assert run(fast, request)[1].token_ids == run(reference, request)[1].token_ids


def test_two_models_compiled_in_one_process_each_run_their_own_weights(tmp_path, byte_tokenizer, isolated_cache):
    """Two models of the same shape, different weights, both compiled: two packages (named by the
    weights), and each model gives its own eager tokens."""
    from tests.tiny import build_model_folder

    request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=8, ignore_eos=True)
    models, eager = [], []
    for seed in (1, 2):
        folder = build_model_folder(tmp_path / f"seed{seed}", "llama", byte_tokenizer, seed=seed)
        loaded = load_model(LoadRequest(str(folder), "fp32-fast", "cpu"))
        eager.append(run(loaded, request)[1].token_ids)
        models.append(loaded)
    assert eager[0] != eager[1]
    for loaded in models:
        assert compile_decoder(loaded.fast, rows=False).built
    assert len(list((isolated_cache / "compiled").glob("step-*.pt2"))) == 2
    assert [run(loaded, request)[1].token_ids for loaded in models] == eager


def test_a_build_process_that_dies_is_reported(long_models, isolated_cache):
    """Killed from outside (out of memory, a user's kill): the report says how it ended, and the
    eager step goes on."""
    import multiprocessing
    import os
    import signal
    import time

    loaded = load_model(LoadRequest(str(long_models["llama"]), "int8-fast", "cpu"))
    reports = []
    thread = compile_in_background(loaded.fast, reports.append)
    deadline = time.monotonic() + 60
    children = []
    while not children and time.monotonic() < deadline:
        children = [p for p in multiprocessing.active_children() if p.name == "fast-path-build"]
        thread.join(0.05)
    assert children, "no build process started"
    os.kill(children[0].pid, signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive()
    assert reports[0].error == f"the build process ended with code {-signal.SIGKILL} before it finished"
    assert loaded.fast.compiled is None
    _, final = run(loaded, GenerationRequest(PROMPT, mode="raw", max_new_tokens=5, ignore_eos=True))
    assert final.tokens == 5


def test_old_packages_and_stale_partial_files_are_pruned(tmp_path):
    """The most recently used packages stay (the one just built always), with their logs; a partial
    file stays while a build may still be writing it, and goes once it is an hour old."""
    import os
    import time

    from engine.generation.compiled_step import PACKAGES_KEPT, _prune

    now = time.time()
    packages = [tmp_path / f"step-{i}.pt2" for i in range(PACKAGES_KEPT + 2)]
    for age, package in enumerate(packages):
        for path in (package, package.with_suffix(".log")):
            path.write_bytes(b"x")
            os.utime(path, (now - 60 * age, now - 60 * age))
    fresh, stale = tmp_path / "step-a.11.partial.pt2", tmp_path / "step-b.12.partial.pt2"
    fresh.write_bytes(b"x")
    stale.write_bytes(b"x")
    os.utime(stale, (now - 7200, now - 7200))
    keep = packages[-1]  # the oldest, but the one just built
    _prune(tmp_path, keep)
    left = sorted(p.name for p in tmp_path.glob("*.pt2"))
    expected = sorted([p.name for p in packages[:PACKAGES_KEPT - 1]] + [keep.name, fresh.name])
    assert left == expected
    assert sorted(p.name for p in tmp_path.glob("*.log")) == sorted(p.with_suffix(".log").name
                                                                    for p in packages[:PACKAGES_KEPT - 1] + [keep])


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma2", "gemma3"])
def test_the_compiled_step_runs_what_an_architecture_does_otherwise(long_models, isolated_cache, arch):
    """The compiled one-sequence step of a Qwen3 (its queries and keys normed per head before the
    rotary embedding), of a Phi-3 (fused projections, the rotary embedding on part of each head),
    of a Gemma 2 (soft-capped scores and logits) and of a Gemma 3 (sliding-window layers over
    their own pool, past their window here) gives the eager step's tokens; Gemma 3's batched step
    too (three sequences of different lengths through the engine core)."""
    loaded = load_model(LoadRequest(str(long_models[arch]), "fp32-fast", "cpu"))
    request = GenerationRequest(PROMPT, mode="raw", max_new_tokens=24, ignore_eos=True)
    batch = [GenerationRequest(PROMPT * k, mode="raw", max_new_tokens=16, ignore_eos=True) for k in (1, 2, 4)]

    def together() -> list[tuple[int, ...]]:
        return core_answers(loaded, batch)

    _, eager = run(loaded, request)
    rows = arch == "gemma3"
    eager_batch = together() if rows else None
    report = compile_decoder(loaded.fast, rows=rows)
    assert report.error is None and report.built
    _, compiled = run(loaded, request)
    assert compiled.token_ids == eager.token_ids
    if rows:
        assert loaded.fast.compiled_rows is not None and together() == eager_batch


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_an_early_exit_views_compiled_step_is_its_own(tiny_models, arch, isolated_cache):
    """A view of the first layers is built into a package of its own, also where the model's own
    fused projections leave the view's weights named as the whole model's (Phi-3)."""
    from engine.generation.compiled_step import package_path
    from engine.models.fast import early_exit_decoder

    loaded = load_model(LoadRequest(str(tiny_models[arch]), "fp32-fast", "cpu"))
    view = early_exit_decoder(loaded.fast, 1)
    assert package_path(view, 2) != package_path(loaded.fast, 2)
