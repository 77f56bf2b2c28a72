"""What runs the engine core's forward passes: the reference runner (transformers' own forward,
one DynamicCache per request, every architecture: cached prefix blocks are copied in and out) or
the fast path's paged cache (engine/generation/paged_cache.py: the KV manager's block pool, blocks
shared in place, one batched decode step). Both hold a cache per request (``add``/``remove``), read prompt chunks
(``prefill``, which can return the scores after each of its last tokens: speculation verifies
with it), decode one token for several requests (``decode``), report each request's KV bytes
and roll a request back (``crop``, for speculation)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.base.kv import cache_bytes

if TYPE_CHECKING:
    import torch

    from engine.models.model import LoadedModel


class ReferenceBatchRunner:
    """The engine core's reference runner: transformers' forward over a DynamicCache, every
    architecture (sliding windows included). A request reads its prompt into a cache of its
    own; once two or more are decoding they join one batched cache (each row left-padded to the
    longest, an attention mask hiding the pads, positions counting only real tokens, as
    ``model.generate`` batches), so a decode step is one forward pass for all; a request that
    ends leaves the batch and the padding no row needs any more is dropped.

    ``rollback`` (speculation): every request keeps its own cache, whose sliding-window layers
    keep what they would drop until :meth:`crop` says how much of it stays."""

    def __init__(self, model, supports_logits_to_keep: bool = True, rollback: bool = False,
                 graphs: bool = False) -> None:
        self.model = model
        self.keeps_logits = supports_logits_to_keep
        self.rollback = rollback
        self.caches: dict[int, object] = {}
        self.lengths: dict[int, int] = {}
        self.wanted: dict[int, int] = {}
        """The tokens each request may come to hold (its prompt and longest answer), from :meth:`add`."""
        self.graphs = graphs
        """Whether a lone request decodes through a captured step (:class:`GraphStep`, CUDA)."""
        self.batch_invariant = False
        """Each request decodes in a forward of its own (no batch padded to its longest row), so its
        answer is the one it gets alone (engine/generation/invariant.py)."""
        self.graph: GraphStep | None = None
        self.graph_error: str | None = None
        """Why the captured step is off after a failed capture (the step runs eager then)."""
        self.group = None
        """The batched cache of the requests decoding together (``None`` until two do)."""
        self.rows: list[int] = []
        """The request of each of its rows."""
        self.mask = None
        """[rows, width]: 1 where a row has a real token, 0 for its padding."""

    def add(self, seq: int, tokens: int = 0, hoped: int = 0) -> None:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        if self.rollback:
            cache.activate_past_recording()
        self.caches[seq], self.lengths[seq], self.wanted[seq] = cache, 0, max(tokens, hoped)

    def remove(self, seq: int) -> None:
        if self.graph is not None and self.graph.seq == seq:
            self.graph.seq = None
        del self.caches[seq], self.lengths[seq], self.wanted[seq]
        if seq in self.rows:
            self._leave(seq)

    def _settle(self, seq: int) -> None:
        """``seq``'s cache back in its own DynamicCache, where the captured step held it."""
        if self.graph is not None and self.graph.seq == seq:
            self.graph.unload(self.caches[seq], self.lengths[seq])

    def _graph_decode(self, seq: int, token: int) -> "torch.Tensor | None":
        """The scores after ``token`` for ``seq`` alone through the captured step (``None``
        where it is off: the caller runs the eager step)."""
        if not self.graphs or self.rollback:
            return None
        length = self.lengths[seq]
        need = max(self.wanted.get(seq, 0), length + 1)
        try:
            if self.graph is None or self.graph.capacity < need:
                if self.graph is not None and self.graph.seq is not None:
                    self._settle(self.graph.seq)
                self.graph = None  # its static cache freed before a larger one is made
                # captured on CUDA; elsewhere (tests on a CPU) the same static step runs eager
                self.graph = GraphStep(self.model, _capacity(need), self.keeps_logits,
                                       capture=self.model.device.type == "cuda")
            if self.graph.seq != seq:
                if self.graph.seq is not None:
                    self._settle(self.graph.seq)
                self.graph.load(seq, self.caches[seq], length)
        except Exception as exc:  # a step that can't be captured (or no memory for it) runs eager
            self.graph, self.graphs = None, False  # a load that failed part-way: seq's own cache is still whole
            self.graph_error = f"{type(exc).__name__}: {exc}"
            return None
        logits = self.graph.step(token)
        self.lengths[seq] += 1
        return logits

    def prefill(self, seq: int, ids: "torch.Tensor", rows: int = 1) -> "torch.Tensor":
        """Put ``ids`` ([1, n]) into ``seq``'s cache; the scores after the last of them
        ([vocab]), or after each of the last ``rows`` ([rows, vocab])."""
        self._settle(seq)
        keep = {"logits_to_keep": rows} if self.keeps_logits else {}
        logits = self.model(input_ids=ids, cache=self.caches[seq], use_cache=True, **keep).logits[0]
        self.lengths[seq] += ids.shape[1]
        return logits[-1] if rows == 1 else logits[-rows:]

    def decode(self, seqs: list[int], tokens: list[int]) -> "torch.Tensor":
        import torch

        device = self.model.device
        if len(seqs) == 1 and seqs[0] not in self.rows and not self.batch_invariant:
            logits = self._graph_decode(seqs[0], tokens[0])
            if logits is not None:
                return logits.unsqueeze(0)
        if self.rollback or (self.batch_invariant and not self.rows) or (len(seqs) == 1 and seqs[0] not in self.rows):
            rows = [self.prefill(seq, torch.tensor([[token]], device=device)) for seq, token in zip(seqs, tokens)]
            return torch.stack(rows)
        for seq in seqs:
            if seq not in self.rows:
                self._join(seq)
        feed = dict(zip(seqs, tokens))
        ids = torch.tensor([[feed.get(seq, 0)] for seq in self.rows], dtype=torch.long, device=device)
        fed = torch.tensor([[seq in feed] for seq in self.rows], dtype=self.mask.dtype, device=device)
        mask = torch.cat([self.mask, fed], dim=1)
        positions = torch.tensor([[self.lengths[seq]] for seq in self.rows], dtype=torch.long, device=device)
        keep = {"logits_to_keep": 1} if self.keeps_logits else {}
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=self.group,
                            use_cache=True, **keep).logits[:, -1]
        self.mask = mask
        for seq in seqs:
            self.lengths[seq] += 1
        index = {seq: row for row, seq in enumerate(self.rows)}
        order = [index[seq] for seq in seqs]
        return logits if order == list(range(len(self.rows))) else logits[order]

    def _join(self, seq: int) -> None:
        """Move ``seq``'s own cache into the batched one, both left-padded to the longer."""
        import torch

        self._settle(seq)
        cache, length = self.caches[seq], self.lengths[seq]
        self.caches[seq] = None
        device = self.model.device
        if self.group is None:
            self.group, self.rows = cache, [seq]
            self.mask = torch.ones((1, length), dtype=torch.long, device=device)
            return
        width = max(self.mask.shape[1], length)
        for mine, theirs in zip(self.group.layers, cache.layers):
            held = width if not getattr(mine, "is_sliding", False) else min(width, mine.sliding_window - 1)
            mine.keys = torch.cat([_left_pad(mine.keys, held), _left_pad(theirs.keys, held)])
            mine.values = torch.cat([_left_pad(mine.values, held), _left_pad(theirs.values, held)])
            if getattr(mine, "is_sliding", False):
                mine.cumulative_length = width
        old = torch.nn.functional.pad(self.mask, (width - self.mask.shape[1], 0))
        new = torch.zeros((1, width), dtype=old.dtype, device=device)
        new[0, width - length:] = 1
        self.mask = torch.cat([old, new])
        self.rows.append(seq)

    def _leave(self, seq: int) -> None:
        """Drop ``seq``'s row, then the leading columns that are padding in every row left."""
        import torch

        row = self.rows.index(seq)
        self.rows.pop(row)
        if not self.rows:
            self.group = self.mask = None
            return
        keep = torch.tensor([i for i in range(len(self.rows) + 1) if i != row], device=self.mask.device)
        self.group.batch_select_indices(keep)
        self.mask = self.mask.index_select(0, keep)
        unused = int((self.mask.sum(dim=0) == 0).int().cumprod(0).sum())
        if unused:
            width = self.mask.shape[1] - unused
            self.mask = self.mask[:, unused:]
            for layer in self.group.layers:
                if getattr(layer, "is_sliding", False):
                    layer.cumulative_length = width
                held = min(layer.keys.shape[2], width)
                layer.keys, layer.values = layer.keys[:, :, -held:], layer.values[:, :, -held:]

    def kv_bytes(self, seq: int) -> int:
        """Bytes of ``seq``'s own tokens in the cache (a batched row's padding, or the static
        cache's unused slots, are not its)."""
        if self.graph is not None and self.graph.seq == seq:
            return _tokens_bytes(self.graph.cache.layers, self.lengths[seq])
        if seq not in self.rows:
            return cache_bytes(self.caches[seq])
        return _tokens_bytes(self.group.layers, self.lengths[seq])

    def prefix_cache_reason(self) -> str | None:
        """Why this model's blocks can't be kept for reuse (``None``: they can)."""
        return None

    def sliding_tokens(self) -> int | None:
        """The most tokens a sliding-window layer keeps (``None``: the model has none): a prefix
        found in the cache needs those layers' keys and values of its last this many tokens only."""
        from transformers import DynamicCache

        windows = [layer.sliding_window - 1 for layer in DynamicCache(config=self.model.config).layers
                   if getattr(layer, "is_sliding", False)]
        return max(windows) if windows else None

    def block_kv(self, seq: int, start: int, end: int) -> tuple[list, list]:
        """A copy of ``seq``'s keys and values of tokens ``start…end``, per layer [1, KV heads, n,
        dim]; ``None`` for a sliding-window layer that no longer holds them all (they left its
        window: a hit ending well after this block doesn't need them, engine/generation/kv_manager.py)."""
        self._settle(seq)
        if seq not in self.rows:
            layers, row = self.caches[seq].layers, 0
            columns = None
        else:  # its row of the batched cache: its real tokens are where its mask is 1
            layers, row = self.group.layers, self.rows.index(seq)
            columns = self.mask[row].nonzero().flatten()[start:end]
        keys, values = [], []
        for layer in layers:
            offset = getattr(layer, "cumulative_length", 0) - layer.keys.shape[2] if getattr(layer, "is_sliding",
                                                                                               False) else 0
            if columns is None:
                if start - offset < 0:
                    keys.append(None), values.append(None)
                    continue
                keys.append(layer.keys[row:row + 1, :, start - offset:end - offset].clone())
                values.append(layer.values[row:row + 1, :, start - offset:end - offset].clone())
            else:
                at = columns - offset
                if int(at.min()) < 0:
                    keys.append(None), values.append(None)
                    continue
                keys.append(layer.keys[row:row + 1].index_select(2, at))
                values.append(layer.values[row:row + 1].index_select(2, at))
        return keys, values

    def load_kv(self, seq: int, blocks: list[tuple[list, list]]) -> None:
        """Put ``blocks`` (from :meth:`block_kv`, in order) at the start of ``seq``'s new cache: a
        sliding-window layer takes the blocks after the last one it lacks (its window's), and
        counts every token before them as seen."""
        import torch

        self._settle(seq)
        cache = self.caches[seq]
        tokens = sum(next(k for k in keys if k is not None).shape[2] for keys, _ in blocks)
        for index in range(len(blocks[0][0])):
            parts = [(keys[index], values[index]) for keys, values in blocks]
            lacking = [i for i, (k, _) in enumerate(parts) if k is None]
            held = parts[lacking[-1] + 1:] if lacking else parts
            cache.update(torch.cat([k for k, _ in held], dim=2), torch.cat([v for _, v in held], dim=2), index)
            if lacking:  # the window's tokens are the last of ``tokens``
                cache.layers[index].cumulative_length = tokens
        self.lengths[seq] = tokens

    def length(self, seq: int) -> int:
        """Tokens ``seq`` has been given (a sliding-window layer may hold fewer)."""
        return self.lengths[seq]

    def __len__(self) -> int:
        """Sequences holding a cache."""
        return len(self.caches)

    def crop(self, seq: int, length: int) -> None:
        """Forget ``seq``'s tokens after the first ``length``; sliding-window layers trim back to
        their window (so this is called even when nothing is forgotten)."""
        self._settle(seq)
        self.caches[seq].crop(-(self.lengths[seq] - length))
        self.lengths[seq] = min(self.lengths[seq], length)


GRAPH_MIN_CAPACITY = 256
"""The smallest static cache of a captured step (tokens); larger ones double from it."""


def _capacity(tokens: int) -> int:
    capacity = GRAPH_MIN_CAPACITY
    while capacity < tokens:
        capacity *= 2
    return capacity


class GraphStep:
    """A lone request's decode step captured once as a CUDA graph over a static cache of
    ``capacity`` tokens (transformers' StaticCache, whose position is a tensor on the device),
    then replayed for every token: one launch where the eager step launches each layer's kernels
    one by one from Python. On a fast GPU a small model's eager decode is bound by those launches,
    not by its weights (benchmarks/cuda_check.py). The request's cache is copied in
    when it starts decoding (:meth:`load`) and back into its own DynamicCache whenever anything
    else needs it (:meth:`unload`). ``capture=False`` runs the same static step eager (a CPU has no
    graphs: the tests check the copies and positions with it)."""

    def __init__(self, model, capacity: int, keeps_logits: bool = True, capture: bool = True) -> None:
        import torch
        from transformers import StaticCache

        self.model, self.capacity, self.seq = model, capacity, None
        self.keep = {"logits_to_keep": 1} if keeps_logits else {}
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        self.ids = torch.zeros((1, 1), dtype=torch.long, device=model.device)
        self.graph = self.out = None
        if not capture:
            self._forward()  # the cache's layers made (they are made at their first update)
            return
        device = model.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm: the cache's layers made, the libraries' handles and workspaces set up
                self._forward()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another model's thread (a side-by-side comparison) keeps working during the capture
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.out = self._forward()
        self.graph = graph

    def _forward(self) -> "torch.Tensor":
        return self.model(input_ids=self.ids, cache=self.cache, use_cache=True, **self.keep).logits

    def load(self, seq: int, cache, length: int) -> None:
        """Copy ``seq``'s ``length`` tokens from its DynamicCache in; its next token goes after them."""
        for static, layer in zip(self.cache.layers, cache.layers):
            static.keys[:, :, :length].copy_(layer.keys[:, :, -length:])
            static.values[:, :, :length].copy_(layer.values[:, :, -length:])
            static.cumulative_length.fill_(length)
        self.seq = seq

    def unload(self, cache, length: int) -> None:
        """The held request's ``length`` tokens back into its DynamicCache ``cache``."""
        for static, layer in zip(self.cache.layers, cache.layers):
            layer.keys = static.keys[:, :, :length].clone()
            layer.values = static.values[:, :, :length].clone()
        self.seq = None

    def step(self, token: int) -> "torch.Tensor":
        """The scores after ``token`` ([vocab]; a copy: the graph's output is overwritten next step)."""
        self.ids.fill_(token)
        if self.graph is None:
            return self._forward()[0, -1]
        self.graph.replay()
        return self.out[0, -1].clone()


def graphs_apply(model) -> bool:
    """Whether :class:`GraphStep` runs ``model``'s lone decode: on CUDA, unquantized weights
    (bitsandbytes' kernels are left eager), no sliding-window layers (a static cache of those
    wraps around), unless ``INFERENCE_WORKBENCH_NO_CUDA_GRAPHS`` is set."""
    import os

    from transformers import DynamicCache

    device = getattr(model, "device", None)
    if getattr(device, "type", None) != "cuda" or os.environ.get("INFERENCE_WORKBENCH_NO_CUDA_GRAPHS"):
        return False
    if getattr(model, "hf_quantizer", None) is not None or getattr(model, "is_quantized", False):
        return False
    return not any(getattr(layer, "is_sliding", False) for layer in DynamicCache(config=model.config).layers)


def _tokens_bytes(layers, length: int) -> int:
    """Bytes of a row's ``length`` tokens in ``layers`` (a sliding-window layer holds at most its
    window's), whatever the tensors' width: a batched cache's padding, a static cache's free slots."""
    total = 0
    for layer in layers:
        keys = layer.keys
        held = min(length, layer.sliding_window - 1) if getattr(layer, "is_sliding", False) else length
        total += 2 * held * keys.shape[1] * keys.shape[3] * keys.element_size()
    return total


def _left_pad(tensor: "torch.Tensor", width: int) -> "torch.Tensor":
    """``tensor`` [batch, heads, tokens, dim] with zeros before its tokens, to ``width`` tokens."""
    import torch

    extra = width - tensor.shape[2]
    if extra <= 0:
        return tensor[:, :, -width:] if extra < 0 else tensor
    return torch.cat([tensor.new_zeros(tensor.shape[0], tensor.shape[1], extra, tensor.shape[3]), tensor], dim=2)


def runner_for(model, fast=None, supports_logits_to_keep: bool = True, rollback: bool = False):
    """An engine-core runner: the fast path's paged cache over ``fast`` (a ``FastDecoder``) where
    there is one, else the reference runner over ``model``."""
    if fast is not None:
        from engine.generation.paged_cache import PagedCache  # lazy: importing it loads numpy, torch

        runner = PagedCache(fast)
        runner.rollback = rollback
        return runner
    return ReferenceBatchRunner(model, supports_logits_to_keep, rollback, graphs=graphs_apply(model))


def batch_runner_for(loaded: "LoadedModel", rollback: bool = False):
    """The engine core's runner for ``loaded``."""
    return runner_for(loaded.model, loaded.fast, loaded.supports_logits_to_keep, rollback)
