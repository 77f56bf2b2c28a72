"""Quantized linear layers for the fast path: one handler per scheme (gpt-fast style).

Decoding one token multiplies a single activation row by every weight matrix, so its cost is
reading the weights: fewer bytes per weight, faster tokens; a prompt or a batch multiplies many
rows, so its cost is the arithmetic. Two families:

- int8 activations (:class:`Int8BlockLinear`, :class:`Int4BlockLinear`), where the CPU has
  AVX-512 VNNI or AVX2: llama.cpp's Q8_0 / Q4_1 weight blocks times activations quantized per
  block of 32 as they arrive, on int8 dot products (engine/models/kernels: the build for this
  CPU is chosen at run time);
- weight-only (:class:`Int8WeightOnlyLinear`, :class:`Int4WeightOnlyLinear`) elsewhere: int8 with
  one scale per output row, int4 with a scale and zero per group of 32 inputs, multiplied by
  PyTorch's CPU weight-only kernels with bf16 activations. Those kernels slow down sharply on very
  tall matrices (a 49152 × 576 vocabulary head ran several times slower than the same bytes in 4096-row
  pieces), so those layers work in row blocks.
"""

from __future__ import annotations

import torch
from torch import nn

HEAD_INT8_UNDER_INT4 = True
"""Keep the output head in int8 under int4, as llama.cpp keeps its output tensor at higher
precision than the layers: at 4 bits the head's errors land directly on the logits."""
ROW_BLOCK = 4096
"""Output rows per kernel call."""
INT4_GROUP = 32
"""Inputs per int4 scale group (128 does not divide SmolLM2's hidden size, 576)."""


def _blocks(rows: int) -> list[tuple[int, int]]:
    return [(start, min(start + ROW_BLOCK, rows)) for start in range(0, rows, ROW_BLOCK)]


class _BlockedLinear(nn.Module):
    """Shared plumbing: bias, output shape, row blocks."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)
        self.blocks = _blocks(out_features)

    def _matmul(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """``x`` times the rows of row block number ``block``."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        if len(self.blocks) == 1:
            out = self._matmul(flat, 0)
        else:
            out = torch.cat([self._matmul(flat, i) for i in range(len(self.blocks))], dim=-1)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8WeightOnlyLinear(_BlockedLinear):
    """int8 weights, one bf16 scale per output row (symmetric, absmax / 127)."""

    def __init__(self, linear: nn.Linear) -> None:
        weight = linear.weight.detach().float()
        super().__init__(weight.shape[1], weight.shape[0], linear.bias)
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        quantized = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        scale = scale.to(torch.bfloat16)
        if len(self.blocks) == 1:
            self.register_buffer("weight", quantized.contiguous())
            self.register_buffer("scales", scale)
        else:  # a tensor per block, not slices of one (see BlockedDenseLinear: frozen slices went wrong)
            for i, (start, end) in enumerate(self.blocks):
                self.register_buffer(f"weight{i}", quantized[start:end].clone())
                self.register_buffer(f"scales{i}", scale[start:end].clone())

    def _matmul(self, x, block):
        if len(self.blocks) == 1:
            return torch._weight_int8pack_mm(x, self.weight, self.scales)
        return torch._weight_int8pack_mm(x, getattr(self, f"weight{block}"), getattr(self, f"scales{block}"))

    @classmethod
    def fuse(cls, parts: list["Int8WeightOnlyLinear"]) -> "Int8WeightOnlyLinear":
        """One layer computing all of ``parts`` (layers reading the same input): one kernel call
        instead of several. The parts' weights become views of the fused ones (no extra memory),
        so they keep working on their own."""
        fused = cls.__new__(cls)
        _BlockedLinear.__init__(fused, parts[0].in_features, sum(p.out_features for p in parts), _fused_bias(parts))
        fused.register_buffer("weight", torch.cat([p.weight for p in parts]))
        fused.register_buffer("scales", torch.cat([p.scales for p in parts]))
        for part, rows in _share_bias(fused, parts):
            part.weight, part.scales = fused.weight[rows], fused.scales[rows]
        return fused


def _fused_bias(parts: list[_BlockedLinear]) -> torch.Tensor | None:
    """The bias of a layer fusing ``parts`` (zeros for a part without one), or ``None``."""
    if all(p.bias is None for p in parts):
        return None
    return torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features, dtype=torch.bfloat16)
                      for p in parts])


def _share_bias(fused: _BlockedLinear, parts: list[_BlockedLinear]) -> list[tuple[nn.Module, slice]]:
    """Each part's rows in ``fused``, its bias made a view of the fused one's."""
    shares, start = [], 0
    for part in parts:
        rows = slice(start, start + part.out_features)
        if part.bias is not None:
            part.bias = nn.Parameter(fused.bias[rows], requires_grad=False)
        shares.append((part, rows))
        start = rows.stop
    return shares


class Int4WeightOnlyLinear(_BlockedLinear):
    """int4 weights (asymmetric, min/max per group of 32 inputs), packed for the CPU kernel."""

    def __init__(self, linear: nn.Linear, group: int = INT4_GROUP) -> None:
        weight = linear.weight.detach().float()
        rows, cols = weight.shape
        if cols % group or rows % 16:
            raise ValueError(f"int4 needs inputs ({cols}) in multiples of {group} and outputs ({rows}) of 16")
        super().__init__(cols, rows, linear.bias)
        grouped = weight.reshape(rows, cols // group, group)
        low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
        scale = ((high - low) / 15.0).clamp(min=1e-12)
        codes = torch.round((grouped - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        # the kernel computes (code − 8) · scale + zero, so zero is the value of code 8
        zero = low + 8 * scale
        self.group = group
        packed = [torch._convert_weight_to_int4pack_for_cpu(codes[start:end].reshape(end - start, cols), 1)
                  for start, end in self.blocks]
        for i, block in enumerate(packed):
            self.register_buffer(f"packed{i}", block)
        scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        for i, (start, end) in enumerate(self.blocks):
            self.register_buffer(f"scales_zeros{i}", scales_zeros[:, start:end].contiguous())

    def _matmul(self, x, block):
        # a fused layer's part holds a view of its scales, which the kernel would read wrong (silently)
        return torch._weight_int4pack_mm_for_cpu(x, getattr(self, f"packed{block}"), self.group,
                                                 getattr(self, f"scales_zeros{block}").contiguous())

    @classmethod
    def fuse(cls, parts: list["Int4WeightOnlyLinear"]) -> "Int4WeightOnlyLinear | None":
        """One layer computing all of ``parts`` (q/k/v, gate/up): one kernel call instead of
        several, the parts' packed weights becoming views of the fused one's rows (no extra
        memory). ``None`` where the parts can't share its rows: the packing interleaves rows in
        blocks of 64, so each part must be a whole number of them (checked by multiplying), all
        in one row block."""
        group = parts[0].group
        rows = sum(p.out_features for p in parts)
        if rows > ROW_BLOCK or any(len(p.blocks) != 1 or p.out_features % 64 or p.group != group for p in parts):
            return None
        fused = cls.__new__(cls)
        _BlockedLinear.__init__(fused, parts[0].in_features, rows, _fused_bias(parts))
        fused.group = group
        fused.register_buffer("packed0", torch.cat([p.packed0 for p in parts]))
        fused.register_buffer("scales_zeros0", torch.cat([p.scales_zeros0 for p in parts], dim=1))
        with torch.no_grad():
            x = torch.randn(1, fused.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
            if not torch.equal(fused._matmul(x, 0), torch.cat([p._matmul(x, 0) for p in parts], -1)):
                return None  # another packing than this one's blocks of 64: the parts stay apart
        for part, share in _share_bias(fused, parts):
            part.packed0, part.scales_zeros0 = fused.packed0[share], fused.scales_zeros0[:, share]
        return fused


BLOCK = 32
"""Inputs per scale block of the int8-activation layers (llama.cpp's Q8_0/Q4_1 blocks)."""


def q8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [N, K] and fp16 scales [N, K/32] of ``weight`` (llama.cpp's Q8_0: symmetric,
    absmax / 127 per block of 32 inputs; the codes divide by the fp16-rounded scale)."""
    rows, cols = weight.shape
    blocks = weight.float().reshape(rows, cols // BLOCK, BLOCK)
    scales = (blocks.abs().amax(dim=-1) / 127.0).to(torch.float16)
    safe = scales.float().clamp(min=1e-30)[..., None]
    codes = torch.round(blocks / safe).clamp(-127, 127).to(torch.int8).reshape(rows, cols)
    return codes, scales


def q4_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit codes [N, K] (uint8, 0…15), fp16 scales and minimums [N, K/32] of ``weight``
    (llama.cpp's Q4_1: w ≈ d · q + m per block of 32 inputs)."""
    rows, cols = weight.shape
    blocks = weight.float().reshape(rows, cols // BLOCK, BLOCK)
    low, high = blocks.amin(dim=-1), blocks.amax(dim=-1)
    d = ((high - low) / 15.0).to(torch.float16)
    m = low.to(torch.float16)
    codes = torch.round((blocks - m.float()[..., None]) / d.float().clamp(min=1e-30)[..., None]).clamp(0, 15)
    return codes.to(torch.uint8).reshape(rows, cols), d, m


def _padded(t: torch.Tensor) -> torch.Tensor:
    """``t`` with zero rows added up to a multiple of 16 rows."""
    extra = -t.shape[0] % 16
    return t if not extra else torch.cat([t, t.new_zeros((extra, *t.shape[1:]))])


def pack_q8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout (q8_gemm.cpp): 16 columns side by side, 4 inputs a lane."""
    codes, scales = _padded(codes), _padded(scales)
    groups, cols = codes.shape[0] // 16, codes.shape[1]
    return (codes.reshape(groups, 16, cols // BLOCK, 8, 4).permute(0, 2, 3, 1, 4).contiguous(),
            scales.reshape(groups, 16, cols // BLOCK).permute(0, 2, 1).contiguous())


def pack_q4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernel's layout: 16 columns side by side, 4 inputs a lane, two groups of 4 a byte."""
    codes, d, m = _padded(codes), _padded(d), _padded(m)
    groups, cols = codes.shape[0] // 16, codes.shape[1]
    c = codes.reshape(groups, 16, cols // BLOCK, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)  # [G, B, v, lane, i, h]
    packed = (c[..., 0] | (c[..., 1] << 4)).contiguous()
    def spread(t):
        return t.reshape(groups, 16, cols // BLOCK).permute(0, 2, 1).contiguous()
    return packed, spread(d), spread(m)


def int8_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernels do to the activations, in plain PyTorch (for tests): int codes [M, K] and
    fp32 scales [M, K/32], absmax / 127 per block, rounded half to even."""
    rows, cols = x.shape
    blocks = x.float().reshape(rows, cols // BLOCK, BLOCK)
    top = blocks.abs().amax(dim=-1)
    # a true division, as the kernels' 127.0f / top: torch's scalar / tensor is a reciprocal times
    # 127, an ulp off at times, which moved a code whose product fell on .5 (x · inverse = 87.5)
    inverse = torch.where(top > 0, torch.full_like(top, 127.0) / top, torch.zeros_like(top))
    codes = torch.round(blocks * inverse[..., None]).reshape(rows, cols)
    return codes, top / 127.0


class _Int8ActivationLinear(_BlockedLinear):
    """Shared by the layers that multiply with int8 activations: one kernel call for every row,
    the output in the activations' dtype (the fast path feeds them fp32: engine/models/fast.py)."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__(in_features, out_features, bias)
        self.blocks = [(0, out_features)]  # the kernel takes a tall matrix whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if flat.dtype not in (torch.float32, torch.bfloat16):
            flat = flat.float()
        out = self._matmul(flat.contiguous(), 0)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)


def has_int8_activations(model: nn.Module) -> bool:
    """Whether ``model``'s linears multiply with int8 activations (the layers between then run in fp32)."""
    return any(isinstance(module, _Int8ActivationLinear) for module in model.modules())


class Int8BlockLinear(_Int8ActivationLinear):
    """int8 weights with an fp16 scale per block of 32 inputs (Q8_0), multiplied with activations
    quantized the same way as they arrive (engine/models/kernels/q8_gemm.cpp): int8 dot products."""

    def __init__(self, linear: nn.Linear) -> None:
        weight = linear.weight.detach()
        if weight.shape[1] % BLOCK:
            raise ValueError(f"int8 blocks need inputs ({weight.shape[1]}) in multiples of {BLOCK}")
        super().__init__(weight.shape[1], weight.shape[0], linear.bias)
        packed, scales = pack_q8(*q8_blocks(weight))
        self.register_buffer("weight", packed)
        self.register_buffer("scales", scales)

    def _matmul(self, x, block):
        out = torch.ops.workbench.q8_linear(x, self.weight, self.scales)
        return out if out.shape[-1] == self.out_features else out[:, :self.out_features]

    @classmethod
    def fuse(cls, parts: list["Int8BlockLinear"]) -> "Int8BlockLinear | None":
        """One layer for all of ``parts``, whose weights become views of its column groups (as
        :meth:`Int8WeightOnlyLinear.fuse`); ``None`` unless each part is whole groups of 16."""
        return _fuse_groups(cls, parts, ("weight", "scales"))


class Int4BlockLinear(_Int8ActivationLinear):
    """4-bit weights with an fp16 scale and minimum per block of 32 inputs (Q4_1), multiplied with
    int8 activations (Q8_1: the block's sum carries the minimum's share)."""

    def __init__(self, linear: nn.Linear) -> None:
        weight = linear.weight.detach()
        if weight.shape[1] % BLOCK:
            raise ValueError(f"int4 blocks need inputs ({weight.shape[1]}) in multiples of {BLOCK}")
        super().__init__(weight.shape[1], weight.shape[0], linear.bias)
        packed, d, m = pack_q4(*q4_blocks(weight))
        self.register_buffer("packed", packed)
        self.register_buffer("d", d)
        self.register_buffer("m", m)

    def _matmul(self, x, block):
        out = torch.ops.workbench.q4_linear(x, self.packed, self.d, self.m)
        return out if out.shape[-1] == self.out_features else out[:, :self.out_features]

    @classmethod
    def fuse(cls, parts: list["Int4BlockLinear"]) -> "Int4BlockLinear | None":
        return _fuse_groups(cls, parts, ("packed", "d", "m"))


def _fuse_groups(cls, parts, names: tuple[str, ...]):
    if any(p.out_features % 16 for p in parts):
        return None
    fused = cls.__new__(cls)
    _Int8ActivationLinear.__init__(fused, parts[0].in_features, sum(p.out_features for p in parts), _fused_bias(parts))
    for name in names:
        fused.register_buffer(name, torch.cat([getattr(p, name) for p in parts]))
    for part, rows in _share_bias(fused, parts):
        groups = slice(rows.start // 16, rows.stop // 16)
        for name in names:
            setattr(part, name, getattr(fused, name)[groups])
    return fused


class BlockedDenseLinear(_BlockedLinear):
    """A plain bf16 or fp32 weight, multiplied in row blocks (the tall head is slow in one piece).
    Each block is a tensor of its own, not a slice of one weight: frozen into a compiled step with
    inductor's C++ GEMM templates, slices of one tensor gave wrong products (every block read as
    the first: the head's logits came out tied)."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype) -> None:
        weight = linear.weight.detach().to(dtype)
        super().__init__(weight.shape[1], weight.shape[0], None)
        self.dtype = dtype
        for i, (start, end) in enumerate(self.blocks):
            self.register_buffer(f"block{i}", weight[start:end].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).to(self.dtype)
        parts = [nn.functional.linear(flat, getattr(self, f"block{i}")) for i in range(len(self.blocks))]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)


class BlockedEmbedding(nn.Module):
    """The input embedding of a model whose head was tied to it, looking its rows up in the head's
    row blocks (:class:`BlockedDenseLinear`): one copy of the table, as the tied model had, where a
    copy for the head would add its whole size (fp32 +108 MiB on the default model)."""

    def __init__(self, head: BlockedDenseLinear, padding_idx: int | None = None,
                 scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.padding_idx = padding_idx
        # what the rows are multiplied by, in their dtype (Gemma's embedding buffer: √hidden size), or None
        self.register_buffer("embed_scale", scale, persistent=False)
        self.blocks = head.blocks
        for i in range(len(self.blocks)):  # the same tensors as the head's (no copy)
            self.register_buffer(f"block{i}", getattr(head, f"block{i}"))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling() and ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < self.num_embeddings:
            # as nn.Embedding says (the blocks' clamped lookups would return another token's row);
            # the compiled step's ids are the engine's own tokens, already checked
            raise IndexError(f"token id out of range: ids must lie in [0, {self.num_embeddings})")
        out = None
        for i, (start, end) in enumerate(self.blocks):
            rows = nn.functional.embedding((ids - start).clamp(0, end - start - 1), getattr(self, f"block{i}"))
            out = rows if out is None else torch.where((ids >= start).unsqueeze(-1), rows, out)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, in {len(self.blocks)} row blocks shared with the head"


def fuse_rows(parts: list[nn.Module]) -> nn.Module | None:
    """A layer computing the concatenated outputs of ``parts`` with one kernel call, sharing
    their memory; ``None`` where the scheme can't (mixed kinds, int4 rows that don't fit its packing)."""
    if all(type(p) is Int8WeightOnlyLinear for p in parts):
        return Int8WeightOnlyLinear.fuse(parts)
    if all(type(p) is Int4WeightOnlyLinear for p in parts):
        return Int4WeightOnlyLinear.fuse(parts)
    for kind in (Int8BlockLinear, Int4BlockLinear):
        if all(type(p) is kind for p in parts):
            return kind.fuse(parts)
    if all(type(p) is nn.Linear for p in parts):
        weight = torch.cat([p.weight.detach() for p in parts])
        has_bias = any(p.bias is not None for p in parts)
        fused = nn.Linear(parts[0].in_features, weight.shape[0], bias=has_bias, device="meta")
        fused.weight = nn.Parameter(weight, requires_grad=False)
        if has_bias:
            fused.bias = nn.Parameter(torch.cat([p.bias.detach() if p.bias is not None else
                                                 torch.zeros(p.out_features, dtype=weight.dtype) for p in parts]),
                                      requires_grad=False)
        start = 0
        for part in parts:
            end = start + part.out_features
            part.weight = nn.Parameter(fused.weight[start:end], requires_grad=False)
            if part.bias is not None:
                part.bias = nn.Parameter(fused.bias[start:end], requires_grad=False)
            start = end
        return fused
    return None


def int8_kernels() -> bool:
    """The int8-activation kernels are there (compiled once per machine; engine/models/kernels)."""
    from engine.models.kernels import kernels  # lazy: it reads /proc/cpuinfo and may compile

    return kernels()


def quantize_linears(model: nn.Module, scheme: str) -> int:
    """Swap every ``nn.Linear`` of ``model`` (the head included) for the ``scheme`` handler, in
    place; return how many were swapped. A quantized head tied to the embeddings gets its own
    copy (the embedding table stays as it is: looking up one row per token reads almost nothing);
    a dense head in row blocks keeps the tie: the embedding looks its rows up in the head's blocks."""
    int8, int4 = Int8WeightOnlyLinear, Int4WeightOnlyLinear
    if scheme in ("int8", "int4") and int8_kernels():
        int8, int4 = Int8BlockLinear, Int4BlockLinear
    make = {"int8": int8, "int4": int4,
            "bf16": lambda linear: BlockedDenseLinear(linear, torch.bfloat16),
            "fp32": lambda linear: BlockedDenseLinear(linear, torch.float32)}[scheme]
    swapped = 0
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = head is not None and embed is not None and head.weight is embed.weight
    for parent, name, child in targets:
        if scheme in ("bf16", "fp32") and child.out_features < ROW_BLOCK * 2:
            continue  # a dense matrix of ordinary height gains nothing from blocks
        try:
            if scheme == "int4" and child is head and HEAD_INT8_UNDER_INT4:
                replacement = int8(child)
            else:
                replacement = make(child)
        except ValueError:  # a shape the kernel can't take: int8 weight-only for this one layer
            replacement = Int8WeightOnlyLinear(child)
        setattr(parent, name, replacement)
        swapped += 1
        if child is head and tied and isinstance(replacement, BlockedDenseLinear):
            model.set_input_embeddings(BlockedEmbedding(replacement, getattr(embed, "padding_idx", None),
                                                        getattr(embed, "embed_scale", None)))
    if hasattr(model.config, "tie_word_embeddings") and swapped:
        model.config.tie_word_embeddings = False  # the head is a separate (quantized) copy now
    return swapped
