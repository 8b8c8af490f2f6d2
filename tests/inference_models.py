"""Tiny Hugging Face models built from configs with a fixed seed (nothing downloaded), shared by
the inference tests and scripts/bench_inference.py's CPU runs."""
from __future__ import annotations

import torch

VOCAB = 1000


def build(kind: str, seed: int = 0, **overrides):
    """A tiny model of `kind` (gpt2, llama, t5, gpt_neo, gptj, bert, mistral) in eval mode."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = tf.GPT2Config(**{**dict(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                                         bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1), **overrides})
        model = tf.GPT2LMHeadModel(cfg)
    elif kind == "llama":
        cfg = tf.LlamaConfig(**{**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                                       num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=128),
                                **overrides})
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "mistral":
        cfg = tf.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=128, **overrides)
        model = tf.MistralForCausalLM(cfg)
    elif kind == "t5":
        cfg = tf.T5Config(d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4, vocab_size=VOCAB,
                          decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **overrides)
        model = tf.T5ForConditionalGeneration(cfg)
    elif kind == "gpt_neo":
        cfg = tf.GPTNeoConfig(hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                              vocab_size=VOCAB, max_position_embeddings=64, window_size=16, **overrides)
        model = tf.GPTNeoForCausalLM(cfg)
    elif kind == "gptj":
        cfg = tf.GPTJConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=VOCAB, n_positions=64,
                            **overrides)
        model = tf.GPTJForCausalLM(cfg)
    elif kind == "bert":
        cfg = tf.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                            vocab_size=VOCAB, max_position_embeddings=64, **overrides)
        model = tf.BertForMaskedLM(cfg)
    else:
        raise ValueError(kind)
    return model.eval()


def policy(kind: str):
    """The explicit injection_policy a user would write for `kind` (the seed's form for T5)."""
    import transformers as tf

    return {
        "gpt2": {tf.models.gpt2.modeling_gpt2.GPT2Block: ("attn.c_proj", "mlp.c_proj")},
        "llama": {tf.models.llama.modeling_llama.LlamaDecoderLayer: ("self_attn.o_proj", "mlp.down_proj")},
        "t5": {tf.models.t5.modeling_t5.T5Block: ("SelfAttention.o", "EncDecAttention.o", "DenseReluDense.wo")},
    }[kind]


def prompt(seed: int = 1, batch: int = 2, length: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if getattr(model.config, "is_encoder_decoder", False):
            return model(input_ids=ids, decoder_input_ids=ids).logits
        return model(input_ids=ids).logits


def greedy(model, ids: torch.Tensor, tokens: int = 32) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)
