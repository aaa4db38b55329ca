"""Makes a tiny Llama-architecture model that a real vLLM can serve, without any hub.

Random weights (2 layers, hidden 128, 2 heads of 64: the CPU attention kernel needs a
head_dim of at least 64) and a byte-level BPE tokenizer trained here on generated text,
with a chat template. The model's output is gibberish; the engine serving it is real
(scheduler, prefix cache, usage with cached tokens, metrics).

usage: python make_tiny_model.py OUT_DIR
"""

import json
import random
import sys
from pathlib import Path


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(7)
    words = ["the", "gateway", "routes", "a", "request", "to", "an", "engine", "with", "its",
             "prefix", "cache", "tool", "system", "user", "assistant", "tokens", "stream",
             "model", "of", "and", "is", "for", "you", "are", "helpful", "json", "code"]
    corpus = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(2000)]
    corpus += ["".join(chr(rng.randrange(32, 127)) for _ in range(200)) for _ in range(500)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>"
        "{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}"
        "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    fast.save_pretrained(out)

    torch.manual_seed(7)
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    print(f"tiny model in {out}: vocab {len(fast)}, {sum(p.numel() for p in model.parameters())} parameters")


if __name__ == "__main__":
    main()
