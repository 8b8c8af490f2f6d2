"""The seed's inference examples on tiny models built here (nothing downloaded), run by
tests/runtime/inference/test_inference_cli.py under `dslaunch --num_gpus 2` and as a single process.

    gpt_neo  generator = pipeline('text-generation', ...); generator.model = deepspeed.init_inference(
             generator.model, mp_size=world_size, dtype=torch.float, replace_with_kernel_inject=True)
    t5       init_inference(model, mp_size=world_size, dtype=torch.float,
             injection_policy={T5Block: ('SelfAttention.o', 'EncDecAttention.o', 'DenseReluDense.wo')})
             (transformers 5 has no text2text-generation pipeline: generate() with the tokenizer)
    bad_*    one argument that init_inference must refuse (exit 2, one line)

Usage: inference_seed.py CASE[,CASE...]; prints one JSON line per rank: {"rank": r, "text": {case: ...}}.
"""
import json
import os
import sys

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import (GPTNeoConfig, GPTNeoForCausalLM, PreTrainedTokenizerFast, T5Config,
                          T5ForConditionalGeneration, pipeline)
from transformers.models.t5.modeling_t5 import T5Block

import dslaunch.runtime as deepspeed

CORPUS = ["DeepSpeed is a deep learning optimization library", "tensor parallelism splits every layer",
          "the quick brown fox jumps over the lazy dog"] * 4


def tokenizer():
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[EOS]", "[UNK]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")


def run(case):
    local_rank = int(os.getenv("LOCAL_RANK", "0"))
    world_size = int(os.getenv("WORLD_SIZE", "1"))
    device = local_rank if torch.cuda.is_available() else -1
    tok = tokenizer()
    torch.manual_seed(0)
    if case == "gpt_neo":
        model = GPTNeoForCausalLM(GPTNeoConfig(hidden_size=64, num_layers=2, num_heads=4, vocab_size=64,
                                               attention_types=[[["global", "local"], 1]], window_size=16,
                                               max_position_embeddings=128, bos_token_id=1, eos_token_id=1))
        generator = pipeline("text-generation", model=model, tokenizer=tok, device=device)
        generator.model = deepspeed.init_inference(generator.model, mp_size=world_size, dtype=torch.float,
                                                   replace_with_kernel_inject=True)
        sampled = generator("DeepSpeed is", do_sample=True, min_length=50, max_new_tokens=20)
        greedy = generator("DeepSpeed is", do_sample=False, max_new_tokens=12)
        text = [sampled[0]["generated_text"], greedy[0]["generated_text"]]
    elif case == "t5":
        model = T5ForConditionalGeneration(T5Config(d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4,
                                                    vocab_size=64, decoder_start_token_id=0, pad_token_id=0,
                                                    eos_token_id=1))
        model = deepspeed.init_inference(model, mp_size=world_size, dtype=torch.float,
                                         injection_policy={T5Block: ("SelfAttention.o", "EncDecAttention.o",
                                                                     "DenseReluDense.wo")})
        ids = tok("DeepSpeed is a deep learning library", return_tensors="pt")
        out = model.generate(**ids, do_sample=False, max_new_tokens=12)
        text = tok.batch_decode(out, skip_special_tokens=True)
    else:
        model = GPTNeoForCausalLM(GPTNeoConfig(hidden_size=48, num_layers=2, num_heads=3, vocab_size=64,
                                               attention_types=[[["global", "local"], 1]], window_size=16))
        bad = {"bad_dtype": dict(dtype=torch.int16), "bad_heads": dict(mp_size=world_size, dtype=torch.float),
               "bad_world": dict(mp_size=3, dtype=torch.float),
               "bad_policy": dict(dtype=torch.float, injection_policy={
                   "GPTNeoBlock": ("attn.attention.out_proj", "mlp.c_projj")})}[case]
        deepspeed.init_inference(model, **bad)
        text = ["not refused"]
    return text


def main():
    cases = [a for a in sys.argv[1:] if not a.startswith("--")][0].split(",")
    texts = {case: run(case) for case in cases}
    print(json.dumps({"rank": int(os.getenv("RANK", "0")), "text": texts}), flush=True)


if __name__ == "__main__":
    main()
