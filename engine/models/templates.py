"""Chat templates for models that ship without one.

A GGUF converted from another format can lose ``tokenizer.chat_template`` (some Gemma 3 GGUFs
carry none), and every chat request to such a model would be refused. llama.cpp recognises a
family's template from the model itself; so does the workbench: where the tokenizer has none, the
architecture names a family, and the family's turn markers are tokens of this vocabulary, that
family's format is used, and the load says so. Written for this project from each family's
published prompt format.
"""

from __future__ import annotations

from dataclasses import dataclass

GEMMA = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\n\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\n' }}"
    "{% if m['role'] != 'assistant' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ m['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
"""Gemma's turns: user and model only (a system prompt opens the next user turn)."""

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML (Qwen, SmolLM…)."""

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
"""Llama 3's headers."""

PHI3 = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
"""Phi-3's and Phi-4-mini's roles between bars."""


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    markers: tuple[str, ...]
    """Tokens the vocabulary must hold for the format to be this model's."""
    template: str


FAMILIES = (
    Family("Gemma", ("gemma", "gemma2", "gemma3", "gemma3_text"), ("<start_of_turn>", "<end_of_turn>"), GEMMA),
    Family("ChatML", ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "smollm3", "llama", "mistral"),
           ("<|im_start|>", "<|im_end|>"), CHATML),
    Family("Phi-3", ("phi3",), ("<|user|>", "<|assistant|>", "<|end|>"), PHI3),
    Family("Llama 3", ("llama",), ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), LLAMA3),
)


def recognise(model_type: str, vocabulary: dict[str, int]) -> Family | None:
    """The family whose format a model without a chat template speaks: its architecture is one of
    the family's and its vocabulary holds the family's turn markers (``None``: none fits)."""
    for family in FAMILIES:
        if model_type in family.model_types and all(marker in vocabulary for marker in family.markers):
            return family
    return None


def ensure_template(tokenizer, model_type: str) -> str:
    """Give ``tokenizer`` a chat template where it has none and its family is recognised; returns
    which template chat requests use, in words (for the load's facts)."""
    if getattr(tokenizer, "chat_template", None):
        return "the model's own"
    family = recognise(model_type, tokenizer.get_vocab())
    if family is None:
        return "none (the model ships without one: raw mode continues text)"
    tokenizer.chat_template = family.template
    return f"{family.name}'s, recognised from the architecture and its tokens (the model ships without one)"
