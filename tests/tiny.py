"""Tiny tokenizers and random-weight models, built from configs in seconds, no downloads."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Memory bandwidth limits how fast a model can generate tokens.",
    "A key-value cache stores attention keys and values for every token.",
    "Café, naïve, résumé, façade, Ångström, jalapeño — accents everywhere.",
    "日本語のテキストと中文文本 mixed with English words.",
    "Emoji: 😀 🚀 🧠 👍🏽 and flags 🇫🇷 in a sentence.",
    "Quantization stores weights in fewer bits: int8, nf4, fp4.",
    "   leading spaces, trailing spaces   and\nnew lines\n\n",
] * 4


def byte_level_tokenizer():
    """A GPT-2 style byte-level BPE tokenizer (like SmolLM2's, Qwen's, Llama-3's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
        unk_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def sentencepiece_tokenizer():
    """A Llama-2 style tokenizer: '▁' for spaces, byte fallback for unknown characters."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = {w for line in CORPUS for w in line.split()}
    pieces += ["▁"] + sorted({"▁" + w for w in words} | set("".join(words)))
    vocab = [(p, 0.0 if i < 259 else -float(len(p) < 3) - 1.0 / (1 + len(p))) for i, p in enumerate(pieces)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


def tiny_config(arch: str, vocab_size: int, **overrides):
    """A small config of one architecture; ``overrides`` change any field."""
    from transformers import (Gemma2Config, Gemma3TextConfig, GPT2Config, LlamaConfig, MistralConfig, Phi3Config,
                              Qwen2Config, Qwen3Config, SmolLM3Config)

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.3, bos_token_id=0, eos_token_id=2, pad_token_id=0,
                  tie_word_embeddings=False)
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen2":
        config = Qwen2Config(**{**common, "num_hidden_layers": 3})
    elif arch == "qwen3":  # query/key norms, and a head dim of its own (not hidden ÷ heads)
        config = Qwen3Config(**{**common, "head_dim": 24})
    elif arch == "smollm3":  # every other layer without the rotary embedding
        config = SmolLM3Config(**{**common, "num_hidden_layers": 4, "no_rope_layers": [1, 0, 1, 0]})
    elif arch == "phi3":  # fused q/k/v and gate/up, the rotary embedding on 3/4 of each head
        config = Phi3Config(**{**common, "partial_rotary_factor": 0.75, "pad_token_id": 0})
    elif arch == "mistral":
        config = MistralConfig(**{**common, "sliding_window": 12})
    elif arch == "gemma2":
        config = Gemma2Config(**{**common, "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 10,
                                 "query_pre_attn_scalar": 16})
    elif arch == "gemma3":  # five local layers (sliding, their own rotary base) then a global one, four norms a layer
        config = Gemma3TextConfig(**{**common, "num_hidden_layers": 6, "head_dim": 16, "sliding_window": 10,
                                     "query_pre_attn_scalar": 16})
    elif arch == "gpt2":
        config = GPT2Config(vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                            initializer_range=0.3, bos_token_id=0, eos_token_id=2)
    else:
        raise ValueError(arch)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def build_model_folder(folder: Path, arch: str, tokenizer, seed: int = 0, **overrides) -> Path:
    """Save a random-weight model of ``arch`` with ``tokenizer`` as a Hugging Face folder."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, overrides.pop("vocab_size", len(tokenizer)), **overrides)
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch in ("gemma2", "gemma3"):  # their norms start at w = 0 (x · (1 + 0)): random ones test the offset
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if "norm" in name:
                    weight.normal_(0.0, 0.3)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_gguf(path: Path, arch: str = "llama", name: str = "small", more=None) -> Path:
    """A small, well-formed GGUF of ``arch`` (two f32 tensors), written with the gguf package:
    enough for its header and tensor table, not a working model. ``more(writer)``: more header
    fields, after the architecture."""
    import numpy as np
    from gguf import GGUFWriter, LlamaFileType

    writer = GGUFWriter(str(path), arch)
    if more is not None:
        more(writer)
    writer.add_name(name)
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_tensor("token_embd.weight", np.ones((64, 32), dtype=np.float32))
    writer.add_tensor("output.weight", np.ones((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def kv_held_ok(loaded, measured: int, predicted: int, requests: int = 1) -> bool:
    """A KV figure against the config's prediction: the reference precisions' caches hold exactly
    the predicted bytes; the fast path's block pool whole 16-token blocks of each layer, at least
    the tokens' bytes and under two blocks more per layer and request (a partly filled last one,
    the next token's; a sliding window's first block, partly before the window)."""
    if loaded.fast is None:
        return measured == predicted
    block = 16 * loaded.info.kv_bytes_per_token
    layer_block = block // loaded.model.config.num_hidden_layers
    return measured % layer_block == 0 and predicted <= measured < predicted + 2 * block * requests


def write_model_gguf(path: Path, folder: Path, arch: str, tokenizer_gguf: Path) -> Path:
    """A working F32 GGUF of the model in ``folder`` (a Hugging Face folder of ``arch``), as
    llama.cpp's converter writes one: its hyperparameters, its tensors under llama.cpp's names (q
    and k unpermuted: the architectures taken here rotate halves, as llama.cpp's neox rope), and
    the tokenizer fields of ``tokenizer_gguf`` (the default model's: a vocabulary the model must
    match)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    reader = gguf.GGUFReader(str(tokenizer_gguf))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = getattr(config, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # Gemma 3's: per kind of layer, the file keeps the global one's
    theta = rope.get("rope_theta") or getattr(config, "rope_theta", 10000.0)
    writer.add_rope_freq_base(float(theta))
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if getattr(config, "attn_logit_softcapping", None):
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor") or 1.0
    if factor < 1.0:
        writer.add_rope_dimension_count(int(head_dim * factor))
    strings = gguf.GGUFValueType.STRING
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind, value = field.types[0], field.contents()
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        elif kind == strings:
            writer.add_string(key, value)
        elif kind == gguf.GGUFValueType.BOOL:
            writer.add_bool(key, value)
        else:
            writer.add_uint32(key, int(value))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        stem, suffix = name.rsplit(".", 1)
        if arch in ("gemma2", "gemma3") and stem.endswith("norm"):  # llama.cpp keeps Gemma's norms as 1 + w
            tensor = tensor + 1
        writer.add_tensor(f"{names.get_name(stem)}.{suffix}", np.ascontiguousarray(tensor.float().numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
